"""Executors: run a ``SchedulerOutput`` on the model's workers (``base.Executor``)."""

from tokenmill.executor.base import Executor, ExecutorError
from tokenmill.executor.uniproc import UniProcExecutor
from tokenmill.executor.worker import Worker, WorkerSpec, build_worker

__all__ = ["Executor", "ExecutorError", "UniProcExecutor", "Worker", "WorkerSpec",
           "build_worker"]
