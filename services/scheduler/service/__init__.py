"""The scheduler's service shell: the I/O around the engine core (``fuseserve.scheduler``).

Redis in (``redis_io``: requests, control, token events), gRPC out (``grpc_worker``: plans to the
workers, results back), worker leases and heartbeats, drain on SIGTERM, Prometheus metrics; and
``scheduler_service.SchedulerService``, which runs the one engine loop (``engine_loop.run_once``)
against them. The planner and core one folder up import none of this (tests/unit/test_import_contracts.py).
"""
