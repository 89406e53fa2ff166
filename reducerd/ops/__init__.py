"""Operations: configuration, logs, metrics, systemd notify, CPU and memory upkeep.

Sits on the reduction core (metrics read the table) and under the service.
"""
