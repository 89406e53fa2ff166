# Copyright 2018 Uber Technologies, Inc. All Rights Reserved.
# Modifications copyright (C) 2019 Uber Technologies, Inc.
# Modifications copyright Microsoft
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# Vendored: horovod.tensorflow.util._executing_eagerly and
# horovod.common.util.is_version_greater_equal_than, the two Horovod helpers the
# vendored suites import from horovod itself (not part of reducer_client's API).

from tensorflow.python.eager import context


def _executing_eagerly():
    """Returns true if eager execution is supported and enabled."""
    return context.executing_eagerly()


def is_version_greater_equal_than(ver, target):
    from packaging import version
    if any([not isinstance(_str, str) for _str in (ver, target)]):
        raise ValueError("This function only accepts string arguments. \n"
                         "Received:\n"
                         "\t- ver (type {type_ver}: {val_ver})"
                         "\t- target (type {type_target}: {val_target})".format(
                            type_ver=(type(ver)),
                            val_ver=ver,
                            type_target=(type(target)),
                            val_target=target,
                         ))

    if len(target.split(".")) != 3:
        raise ValueError("We only accepts target version values in the form "
                         "of: major.minor.patch. Received: {}".format(target))

    return version.parse(ver) >= version.parse(target)
