"""reducerd.service.access: job tokens derived from the daemon token, and what each grants."""

import pytest

from reducerd.service.access import EVERY_JOB, Access, Grant, bearer_token, job_token, token_job


def test_a_job_token_names_its_job_and_grants_it_alone():
    access = Access("daemon")
    token = job_token("daemon", "job-a")
    assert token.startswith("rj1.") and token_job(token) == "job-a"
    assert access.grant(token) == Grant("job-a")
    assert access.grant(token.encode()) == Grant("job-a")
    assert access.grant("daemon") is EVERY_JOB
    assert Grant("job-a").allows("job-a") and not Grant("job-a").allows("job-b")
    assert EVERY_JOB.allows("anything")
    assert "job 'job-a'" in Grant("job-a").refusal("job-b")


@pytest.mark.parametrize("token", [None, "", "daemonx", "rj1.", "rj1.am9iLWE.", "rj1.%%%.00",
                                   job_token("another daemon", "job-a"), b"\xff\xfe"])
def test_a_missing_forged_or_foreign_token_grants_nothing(token):
    assert Access("daemon").grant(token) is None


def test_without_a_daemon_token_everyone_may_do_everything():
    assert Access(None).grant(None) is EVERY_JOB
    assert Access(None).grant_for_metadata(()) is EVERY_JOB
    assert not Access(None).required and Access("t").required


def test_bearer_token_reads_the_authorization_entry():
    assert bearer_token([("x", "y"), ("authorization", "Bearer abc")]) == "abc"
    assert bearer_token([("authorization", "Basic abc")]) is None
    assert bearer_token(None) is None
    assert Access("t").grant_for_metadata([("authorization", "Bearer t")]) is EVERY_JOB


def test_job_names_of_any_characters_round_trip():
    for job in ("a", "job/é 1", "x" * 300, "a.b.c"):
        assert token_job(job_token("t", job)) == job
    with pytest.raises(ValueError):
        job_token("t", "")
