"""The data layer: runs, tasks and their states, services, metrics per step and model versions.

SQLAlchemy 2 ORM over SQLite by default (a file under the project data directory, ``.dmsc/`` or
``$DMSC_HOME``); any SQLAlchemy URL (``postgresql+psycopg://...``) selects another engine.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import create_engine, event, exc, select
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.orm import Session, sessionmaker

from dmsc.data import storage
from dmsc.data.calibration_records import RecalibrationRecord
from dmsc.data.records import (
    TASK_STATES,
    AlertRecord,
    ApiKeyRecord,
    Base,
    CheckpointRecord,
    DecisionRecord,
    FaultRecord,
    IdentityRecord,
    MetricRecord,
    ModelVersionRecord,
    ReplicaWeightsRecord,
    RunRecord,
    ScaleEventRecord,
    ServiceRecord,
    StepTraceRecord,
    TaskRecord,
    TenantRecord,
    _now,
)


def data_dir() -> Path:
    """Where dmsc keeps its database, checkpoints and control-plane state."""
    path = Path(os.environ.get("DMSC_HOME", ".dmsc"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def control_file() -> Path:
    """Where a running control plane leaves its address and pid (under the data directory)."""
    return data_dir() / "control.json"


def default_url() -> str:
    return os.environ.get("DMSC_DATABASE_URL", f"sqlite:///{data_dir() / 'dmsc.sqlite'}")


# the tables are defined apart (dmsc.data.records) and importable from here too
__all__ = [
    "TASK_STATES",
    "AlertRecord",
    "ApiKeyRecord",
    "Base",
    "CheckpointRecord",
    "Database",
    "DecisionRecord",
    "FaultRecord",
    "IdentityRecord",
    "MetricRecord",
    "ModelVersionRecord",
    "RecalibrationRecord",
    "ReplicaWeightsRecord",
    "RunRecord",
    "ScaleEventRecord",
    "ServiceRecord",
    "StepTraceRecord",
    "StorageError",
    "TaskRecord",
    "TenantRecord",
    "control_file",
    "data_dir",
    "default_url",
]

RecordT = TypeVar("RecordT", bound=Base)


class StorageError(RuntimeError):
    """The database cannot be opened, read or written (a read-only or full file system, a file
    gone, a server down). The message names the database and the reason, never the statement or
    its parameters; the CLI prints it, the gateway answers 503."""


def _storage_error(url: str, ctx: ExceptionContext) -> StorageError | None:
    """The engine's failure as a :class:`StorageError` when the storage is at fault (SQLAlchemy
    raises what this returns); a constraint or a bad statement stays what it is, and so does a
    failed pre-ping (the pool reconnects on it)."""
    err = ctx.sqlalchemy_exception
    if ctx.is_pre_ping:
        return None
    if not isinstance(err, exc.OperationalError | exc.InterfaceError) and (
        type(err) is not exc.DatabaseError
    ):
        return None
    return StorageError(
        storage.failure(url, ctx.statement, ctx.original_exception, ctx.connection is not None)
    )


class Database:
    """Sessions on one engine, and the few writes the runtime makes. A statement the storage
    refuses raises :class:`StorageError`."""

    def __init__(self, url: str | None = None, new_beside_salvaged: bool = False) -> None:
        """Open (and make, when missing) the database at ``url``. A SQLite file is not made
        beside a salvaged copy of the one it replaces (:func:`storage.new_beside_salvaged`:
        :class:`StorageError`) unless ``new_beside_salvaged``."""
        self.url = url or default_url()
        file = storage.sqlite_file(self.url)
        why = storage.new_beside_salvaged(file) if file is not None else None
        if why is not None and not new_beside_salvaged:
            raise StorageError(f"not making a new database: {why}")
        if self.url.startswith("sqlite"):
            # Several threads and processes write here (control plane, queue worker, gateway):
            # write-ahead logging lets readers run beside the writer, and a writer waits for the
            # lock instead of failing at once.
            self.engine = create_engine(
                self.url, connect_args={"timeout": 30}, hide_parameters=True
            )

            @event.listens_for(self.engine, "connect")
            def _pragmas(dbapi_conn: Any, _record: Any) -> None:
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA busy_timeout=30000")
                cur.close()
        else:
            self.engine = create_engine(self.url, pool_pre_ping=True, hide_parameters=True)
        url = self.url
        event.listen(self.engine, "handle_error", lambda ctx: _storage_error(url, ctx))
        Base.metadata.create_all(self.engine)
        self._add_missing_columns()
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.identity = self._identity()

    def _identity(self) -> str:
        """The database's identity token (:class:`IdentityRecord`), made with it ("" for an
        older database that cannot be written now: a read-only one still opens to be read)."""
        try:
            with self.sessions() as s, s.begin():
                row = s.scalars(select(IdentityRecord).order_by(IdentityRecord.id)).first()
                if row is None:
                    row = IdentityRecord(token=uuid.uuid4().hex)
                    s.add(row)
                return row.token
        except StorageError:
            return ""

    def run_key(self, run_id: int) -> str:
        """The name of run ``run_id``'s checkpoint folder: ``run<id>-<identity>``, so that run 1
        of a new database never writes into the folder of run 1 of a lost one."""
        return f"run{run_id}-{self.identity[:8]}" if self.identity else f"run{run_id}"

    def _add_missing_columns(self) -> None:
        """Bring a database made by an older dmsc up to date: add the columns it lacks (new
        columns are nullable or have defaults, so ADD COLUMN suffices on SQLite and PostgreSQL)."""
        from sqlalchemy import inspect, text

        insp = inspect(self.engine)
        with self.engine.begin() as conn:
            for table in Base.metadata.sorted_tables:
                have = {c["name"] for c in insp.get_columns(table.name)}
                for col in table.columns:
                    if col.name in have:
                        continue
                    kind = col.type.compile(dialect=self.engine.dialect)
                    default = ""
                    if col.default is not None and getattr(col.default, "is_scalar", False):
                        value = getattr(col.default, "arg", None)
                        default = (
                            f" DEFAULT {value!r}" if isinstance(value, str) else f" DEFAULT {value}"
                        )
                    conn.execute(
                        text(f"ALTER TABLE {table.name} ADD COLUMN {col.name} {kind}{default}")
                    )

    def add(
        self, record: RecordT, task_params: tuple[int, dict[str, Any]] | None = None
    ) -> RecordT:
        """Store ``record``; with ``task_params`` (a task's id and parameters), store those in
        the same transaction (a checkpoint and the first step it moved a task to: both or
        neither, whenever the process dies)."""
        with self.sessions() as s, s.begin():
            s.add(record)
            if task_params is not None:
                task = s.get(TaskRecord, task_params[0])
                if task is None:
                    raise KeyError(f"no task {task_params[0]}")
                task.params_json = json.dumps(task_params[1])
        return record

    def new_run(self, model: str, cluster: str, plan: dict[str, Any]) -> RunRecord:
        return self.add(RunRecord(model=model, cluster=cluster, plan_json=json.dumps(plan)))

    def resume_or_new_run(self, model: str, cluster: str, plan: dict[str, Any]) -> RunRecord:
        """The run a control plane serves ``plan`` in. After a crash (a run of the same plan still
        ``running``) the run resumes: its queued tasks stay queued, the tasks that were running
        go back to the queue, and a ``control-plane`` fault records the restart (closed by
        :meth:`close_control_plane_faults` once the workers are back). A run that never
        started (no services recorded, no tasks: its deployment failed to start) is taken
        again as it is, without a fault: nothing restarted. Else a new run."""
        plan_json = json.dumps(plan)
        with self.sessions() as s, s.begin():
            run = s.scalars(
                select(RunRecord)
                .where(RunRecord.status == "running", RunRecord.plan_json == plan_json)
                .order_by(RunRecord.id.desc())
            ).first()
            if run is not None and not self._ever_started(s, run.id):
                return run
            if run is not None:
                interrupted = list(
                    s.scalars(
                        select(TaskRecord).where(
                            TaskRecord.run_id == run.id, TaskRecord.state == "running"
                        )
                    )
                )
                for task in interrupted:
                    task.state = "queued"
                s.add(
                    FaultRecord(
                        run_id=run.id,
                        kind="control-plane",
                        reason="the control plane restarted; running tasks requeued: "
                        + (", ".join(str(t.id) for t in interrupted) or "none"),
                        detected_at=time.time(),
                    )
                )
                return run
        return self.new_run(model, cluster, plan)

    @staticmethod
    def _ever_started(s: Session, run_id: int) -> bool:
        """Whether run ``run_id`` ever served: services recorded or tasks queued."""
        for table in (ServiceRecord, TaskRecord):
            if s.scalars(select(table.id).where(table.run_id == run_id).limit(1)).first():
                return True
        return False

    def end_run(self, run_id: int) -> None:
        """A clean stop: the run is over (a crash leaves it ``running``, to be resumed)."""
        with self.sessions() as s, s.begin():
            run = s.get(RunRecord, run_id)
            if run is not None:
                run.status = "stopped"

    def close_control_plane_faults(self, run_id: int, checkpoint_step: int | None) -> int:
        """Mark the run's open control-plane restarts recovered (now, resumed from the
        checkpoint of ``checkpoint_step``); returns how many there were."""
        with self.sessions() as s, s.begin():
            open_faults = list(
                s.scalars(
                    select(FaultRecord).where(
                        FaultRecord.run_id == run_id,
                        FaultRecord.kind == "control-plane",
                        FaultRecord.recovered_at.is_(None),
                    )
                )
            )
            for fault in open_faults:
                fault.recovered_at = time.time()
                fault.checkpoint_step = checkpoint_step
            return len(open_faults)

    def add_service(
        self, run_id: int, sid: str, stage: int, replica: int, address: str
    ) -> ServiceRecord:
        """Record a service instance started for the run (a replacement adds another row)."""
        return self.add(
            ServiceRecord(run_id=run_id, sid=sid, stage=stage, replica=replica, address=address)
        )

    def services(self, run_id: int) -> list[ServiceRecord]:
        """The run's service instances, in the order they were recorded."""
        with self.sessions() as s:
            q = select(ServiceRecord).where(ServiceRecord.run_id == run_id)
            return list(s.scalars(q.order_by(ServiceRecord.id)))

    def new_task(
        self, run_id: int, kind: str, params: dict[str, Any], state: str = "queued"
    ) -> TaskRecord:
        """A task row. Work the control plane runs at once is created ``running``: a ``queued``
        row is the task queue's to claim, and it would run the task a second time."""
        started = _now() if state == "running" else None
        return self.add(
            TaskRecord(
                run_id=run_id,
                kind=kind,
                params_json=json.dumps(params),
                state=state,
                started_at=started,
                # running at once is its first attempt, as a queued task's claim counts one
                attempts=1 if state == "running" else 0,
            )
        )

    def set_task_state(self, task_id: int, state: str, error: str | None = None) -> None:
        with self.sessions() as s, s.begin():
            task = s.get(TaskRecord, task_id)
            if task is None:
                raise KeyError(f"no task {task_id}")
            task.state = state
            if state == "running":
                task.started_at = _now()
            if state in ("done", "failed", "cancelled"):
                task.finished_at = _now()
                task.error = error

    def add_metric(
        self,
        task_id: int,
        step: int,
        loss: float,
        step_s: float,
        tokens_per_s: float,
        val_loss: float | None = None,
    ) -> None:
        self.add(
            MetricRecord(
                task_id=task_id,
                step=step,
                loss=loss,
                step_s=step_s,
                tokens_per_s=tokens_per_s,
                val_loss=val_loss,
            )
        )

    def drop_metrics_from(self, task_id: int, step: int) -> int:
        """Forget the metrics of steps ``step`` and later (they are run again after a
        recovery); returns how many rows went."""
        from sqlalchemy import delete

        with self.sessions() as s, s.begin():
            for table in (StepTraceRecord, MetricRecord):
                gone = s.execute(delete(table).where(table.task_id == task_id, table.step >= step))
            return int(getattr(gone, "rowcount", 0) or 0)

    def scale_events(self, run_id: int) -> list[ScaleEventRecord]:
        """The run's serving replicas added and removed, oldest first."""
        with self.sessions() as s:
            q = select(ScaleEventRecord).where(ScaleEventRecord.run_id == run_id)
            return list(s.scalars(q.order_by(ScaleEventRecord.id)))

    def faults(self, run_id: int) -> list[FaultRecord]:
        with self.sessions() as s:
            q = select(FaultRecord).where(FaultRecord.run_id == run_id)
            return list(s.scalars(q.order_by(FaultRecord.id)))

    def last_checkpoint(self, run_id: int, task_id: int | None = None) -> CheckpointRecord | None:
        """The run's newest checkpoint (of one task, when given)."""
        with self.sessions() as s:
            q = select(CheckpointRecord).where(CheckpointRecord.run_id == run_id)
            if task_id is not None:
                q = q.where(CheckpointRecord.task_id == task_id)
            return s.scalars(q.order_by(CheckpointRecord.id.desc())).first()

    def checkpoints(
        self, run_id: int, task_id: int | None = None, refused: bool = False
    ) -> list[CheckpointRecord]:
        """The run's checkpoints (of one task, when given), newest first; those a recovery
        refused only with ``refused``."""
        with self.sessions() as s:
            q = select(CheckpointRecord).where(CheckpointRecord.run_id == run_id)
            if task_id is not None:
                q = q.where(CheckpointRecord.task_id == task_id)
            if not refused:
                q = q.where(CheckpointRecord.refused.is_(None))
            return list(s.scalars(q.order_by(CheckpointRecord.id.desc())))

    def refuse_checkpoint(self, checkpoint_id: int, reason: str) -> None:
        """Mark a checkpoint that did not verify: recoveries no longer try it."""
        with self.sessions() as s, s.begin():
            rec = s.get(CheckpointRecord, checkpoint_id)
            if rec is not None:
                rec.refused = reason[:2000]

    def add_restart_steps_lost(self, run_id: int, steps: int) -> None:
        """Count ``steps`` run again (after a resumed task's checkpoint) against the run's
        newest control-plane restart."""
        with self.sessions() as s, s.begin():
            fault = s.scalars(
                select(FaultRecord)
                .where(FaultRecord.run_id == run_id, FaultRecord.kind == "control-plane")
                .order_by(FaultRecord.id.desc())
            ).first()
            if fault is not None:
                fault.steps_lost += steps

    def set_task_params(self, task_id: int, params: dict[str, Any]) -> None:
        with self.sessions() as s, s.begin():
            task = s.get(TaskRecord, task_id)
            if task is None:
                raise KeyError(f"no task {task_id}")
            task.params_json = json.dumps(params)

    def set_task_result(self, task_id: int, result: dict[str, Any]) -> None:
        with self.sessions() as s, s.begin():
            task = s.get(TaskRecord, task_id)
            if task is None:
                raise KeyError(f"no task {task_id}")
            task.result_json = json.dumps(result)

    def recent_tasks(
        self, tenant: str | None = None, state: str | None = None, limit: int = 100
    ) -> list[TaskRecord]:
        """The newest ``limit`` tasks, newest first (of ``tenant``, in ``state``, if given)."""
        q = select(TaskRecord).order_by(TaskRecord.id.desc()).limit(limit)
        if tenant is not None:
            q = q.where(TaskRecord.tenant == tenant)
        if state is not None:
            q = q.where(TaskRecord.state == state)
        with self.sessions() as s:
            return list(s.scalars(q))

    def metrics(self, task_id: int) -> list[MetricRecord]:
        with self.sessions() as s:
            q = (
                select(MetricRecord)
                .where(MetricRecord.task_id == task_id)
                .order_by(MetricRecord.step)
            )
            return list(s.scalars(q))

    def tasks(self, run_id: int | None = None) -> list[TaskRecord]:
        with self.sessions() as s:
            q = select(TaskRecord).order_by(TaskRecord.id)
            if run_id is not None:
                q = q.where(TaskRecord.run_id == run_id)
            return list(s.scalars(q))

    def versions(self, run_id: int) -> list[ModelVersionRecord]:
        with self.sessions() as s:
            q = select(ModelVersionRecord).where(ModelVersionRecord.run_id == run_id)
            return list(s.scalars(q.order_by(ModelVersionRecord.step)))

    def model_versions(self) -> list[ModelVersionRecord]:
        """Every model version, oldest first."""
        with self.sessions() as s:
            return list(s.scalars(select(ModelVersionRecord).order_by(ModelVersionRecord.id)))
