"""What ``docs/benchmarks.md`` shows of each benchmark's results (:mod:`benchmarks.report` renders it): per
family of result files, its tables of the figures that matter, each row a label, a unit and the JSON path of
each column's figure (phalanx, the peers that ran beside it, the code before a change). Declarations only:
the figures themselves are read from the JSON when the page is rendered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["FAMILIES", "Fact", "Family", "Row", "Run", "Table"]


@dataclass(frozen=True)
class Row:
    """One measured quantity: its label, its unit (see :func:`with_unit`) and, per column of its table, the
    JSON path of that column's figure; ``{run}`` in a path stands for the key of the table's run."""

    label: str
    unit: str
    cells: Mapping[str, str]
    compare: bool = True  # the table's ratio column applies (not for counts, where a ratio says nothing)
    null: str = "n/a"  # what a JSON null reads as (e.g. a launcher that never caught the hang)


@dataclass(frozen=True)
class Run:
    """A part of a result file that repeats the same figures (a variant, a setting, the code before a
    change): ``key`` is its JSON path ("" for the whole file), ``label`` its name on the page, in which
    ``{field}`` is filled from the run's own scalar fields and ``{key}`` is the last part of its key."""

    key: str
    label: str = ""


@dataclass(frozen=True)
class Table:
    """A table of figures; by default a row per quantity (per run, under the run's label) and a column per
    arm, with a ratio column dividing the first of ``ratio`` by the second. With ``by_run`` the runs are
    the rows and the quantities the columns, for many runs of few figures."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[Row, ...]
    runs: tuple[Run, ...] = (Run(""),)
    ratio: tuple[str, str] | None = None
    units: Mapping[str, str] = field(default_factory=dict)  # a column's unit where it is not the row's
    by_run: bool = False


@dataclass(frozen=True)
class Fact:
    """A figure of a run's set-up, shown in one line above its tables."""

    label: str
    unit: str
    path: str


@dataclass(frozen=True)
class Family:
    """The results of ``benchmarks/<name>.py``: ``<name>.json``, and ``<name>-<variant>.json`` (or
    ``<name>_<variant>.json``) for its other runs."""

    name: str
    title: str
    tables: tuple[Table, ...]
    setup: tuple[Fact, ...] = ()
    plot: str | None = None  # the name of its plot in "Beside the peers"


def across(template: str, arms: Mapping[str, str]) -> dict[str, str]:
    """One path per column: ``template`` with ``{arm}`` replaced by each column's key in the JSON (most
    results keep each arm under its own key, so the rows of a table differ only in the field)."""
    return {column: template.replace("{arm}", key) for column, key in arms.items()}


def rows(
    template: str,
    arms: Mapping[str, str],
    *figures: tuple[str, str, str],
    compare: bool = True,
    null: str = "n/a",
) -> tuple[Row, ...]:
    """Rows whose paths differ only in the arm and the field: per ``(label, unit, key)``, ``template`` with
    ``{key}`` and then ``{arm}`` replaced. A count (no unit) gets no ratio: two counts in a ratio say little
    that the counts themselves do not."""
    return tuple(
        Row(
            label,
            unit,
            across(template.replace("{key}", key), arms),
            compare=compare and unit != "",
            null=null,
        )
        for label, unit, key in figures
    )


# The figures that matter, per benchmark. Column names are what the reader sees; the JSON keys are beside.
VALUE = {"value": ""}  # the one column of a table with a row per run
LAUNCHERS = {"phalanx-run": "phalanx", "torchrun": "torchrun"}
GOODPUT_LAUNCHERS = {"phalanx local": "phalanx", "torchrun": "torchrun", "dlrover-run": "dlrover"}
SAVERS = {
    "phalanx flash": "phalanx",
    "DLRover flash": "dlrover",
    "dcp.async_save": "dcp_async",
    "torch.save to /dev/shm": "torch_save_shm",
    "torch.save to disk": "torch_save_disk",
}
SAVERS_IN_TRAINING = {
    "phalanx flash": "phalanx",
    "phalanx, copying behind training": "phalanx_behind",
    "DLRover flash": "dlrover",
}
FIRST_SAVE = {"blocks training": "blocking_s", "/ the steady save beside it": "ratio_median"}
AT_ONCE = (  # the first saves without a steady one beside them
    ("after a restart, at once", "s", "first_restarted_at_once"),
    ("after a load from storage, at once", "s", "first_after_storage_load_at_once"),
)
STORAGES = {"local disk": "local_disk", "S3 (MinIO over loopback)": "s3_minio_loopback"}
SATURATED = {
    "phalanx, streams": "stream_saturated",
    "before the change, streams": "baseline_stream_saturated",
    "phalanx, unary calls": "saturated",
    "before the change, unary": "baseline_saturated",
    "gRPC's floor, streams": "grpc_floor_stream",
    "gRPC's floor, unary": "grpc_floor_unary",
}
PACED = {
    "unary, answered at once": "paced_1hz",
    "unary, held": "held_1s",
    "streams, held (the agents' way)": "stream_held_1s",
}
HEARTBEATS = (
    ("heartbeats answered", "/s", "heartbeats_per_s"),
    ("latency, p50", "ms", "p50_ms"),
    ("latency, p99", "ms", "p99_ms"),
    ("master CPU", "cores", "master_cpu_cores"),
    ("heartbeats per second of master CPU", "/s", "heartbeats_per_master_cpu_s"),
)
FLEET = {"phalanx": "phalanx", "torchrun (restarts the whole job)": "torchrun_whole_job"}
PERCENTILES = {"p50": "p50", "p99": "p99", "max": "max"}
FOLD_IN = {"train on, fold in (phalanx)": "train_on", "wait for the replacement": "wait"}
REGROUP = {
    "in-process regroup": "inprocess",
    "superseded round": "superseded",
    "worker restart": "restart",
    "phalanx local": "local",
    "phalanx local, default heartbeats": "local-default",
    "torchrun": "torchrun",
}
LAUNCHER_OVERHEAD = {"phalanx-run": "phalanx_run", "torchrun": "torchrun"}
LAUNCHER_CPU = {"phalanx-run": "phalanx-run", "torchrun": "torchrun"}
PROBES = {"warm probe (phalanx)": "warm", "cold probe": "cold"}
STRAGGLERS = {"shipped settings": "defaults", "fast settings": "fast"}
HANG_BLAME = {"the stopped node": "stopped", "its peer (the victim)": "peer"}
RECORDER = {"without the recorder": "without", "with the recorder": "with"}
ISOLATION = {
    "no probes (as torchrun)": "none",
    "probes, confirmed twice (default)": "confirm2",
    "probes, first verdict evicts": "confirm1",
    "cold probes, confirmed twice": "confirm2_cold",
    "cold probes, first verdict evicts": "confirm1_cold",
}
RECORD_COST = {"recorder": "", "Python write path": "python.", "C write path": "c."}
BEFORE_AFTER = {"before the change": "before", "after": "after"}
PAIRED = "after / before, paired in one process"
HOST_FAULTS = {"killed": "kill", "hung": "hang"}
NOW_BEFORE = {"now": "", "before the change": "before_the_change."}
CLUSTERS = {"containers": "containers", "processes": "processes"}

FAMILIES: tuple[Family, ...] = (
    Family(
        "recovery",
        "Recovery after a worker kill",
        plot="recovery",
        setup=(
            Fact("nodes", "", "setup.nodes"),
            Fact("processes per node", "", "setup.nproc_per_node"),
            Fact("optimizer", "text", "setup.optimizer"),
            Fact("extra state per rank", "MiB", "setup.state_mb"),
            Fact("runs per launcher", "", "setup.runs"),
            Fact("load average before", "", "setup.load_average_before"),
        ),
        tables=(
            Table(
                "worker SIGKILL, median of runs",
                tuple(LAUNCHERS),
                ratio=("phalanx-run", "torchrun"),
                runs=(
                    Run(""),
                    Run("before", "before the change"),
                    Run("after_warm_spares_preimport_dynamo", "warm spares preimporting torch._dynamo"),
                    Run("after_replayed_imports", "warm spares replaying the recorded imports"),
                    Run("after_replayed_imports_busy_machine", "the same, on a busy machine"),
                ),
                rows=rows(
                    "{run}.{arm}.{key}",
                    LAUNCHERS,
                    ("kill → next completed step", "s", "median_recovery_s"),
                    ("kill → script started again", "s", "median_kill_to_script_start_s"),
                    ("kill → ready to train", "s", "median_kill_to_ready_s"),
                    ("steps trained again", "", "median_steps_lost"),
                    ("runs recovered", "", "succeeded"),
                ),
            ),
        ),
    ),
    Family(
        "goodput",
        "Goodput under repeated failures",
        plot="goodput",
        setup=(
            Fact("minutes per launcher", "min", "config.minutes_per_launcher"),
            Fact("a fault every", "s", "config.fault_interval_s"),
            Fact("simulated compute per step", "s", "config.step_time_s"),
            Fact("nodes", "text", "config.nodes"),
            Fact("checkpoints", "text", "config.checkpoint"),
            Fact("DLRover", "text", "dlrover.version"),
        ),
        tables=(
            Table(
                "one seeded fault schedule",
                tuple(GOODPUT_LAUNCHERS),
                ratio=("phalanx local", "torchrun"),
                rows=rows(
                    "launchers.{arm}.{key}",
                    GOODPUT_LAUNCHERS,
                    ("effective training time", "share", "effective_training_time"),
                    ("steps completed", "", "steps_completed"),
                    ("time lost to faults", "s", "lost_s_total"),
                    ("lost per worker kill, median", "s", "lost_s_median_worker-kill"),
                    ("lost per node kill, median", "s", "lost_s_median_node-kill"),
                    ("lost per hang, median", "s", "lost_s_median_hang"),
                    ("clean step", "s", "clean_step_s"),
                )
                + rows(
                    "launchers.{arm}.time_by_phase_s.{key}",
                    GOODPUT_LAUNCHERS,
                    ("spent detecting faults", "s", "detect_s"),
                    ("spent re-forming", "s", "reform_s"),
                    ("spent at a smaller world", "s", "reduced_world_s"),
                    ("spent unrecovered until the next fault", "s", "unrecovered_s"),
                    compare=False,
                ),
            ),
        ),
    ),
    Family(
        "checkpoint",
        "Flash checkpoint: what a save blocks training for",
        plot="checkpoint",
        setup=(
            Fact("state", "B", "size_bytes"),
            Fact("state", "GiB", "size_gb"),
            Fact("torch threads", "", "torch_threads"),
            Fact("memcpy of the state, one thread", "s", "memcpy_limit_s"),
            Fact("device-to-host copy of the state, pinned", "s", "d2h_limit_s"),
        ),
        tables=(
            Table(
                "per save, median",
                tuple(SAVERS),
                ratio=("phalanx flash", "DLRover flash"),
                rows=(
                    *rows(
                        "results.{arm}.{key}",
                        SAVERS,
                        ("steady save blocks training", "s", "blocking_s"),
                        ("first save of a process blocks training", "s", "first_blocking_s"),
                    ),
                    Row(
                        "first save, phalanx interleaved with DLRover's runs",
                        "s",
                        {
                            "phalanx flash": "results.dlrover.phalanx_interleaved.first_blocking_s",
                            "DLRover flash": "results.dlrover.first_blocking_s",
                        },
                    ),
                    Row(
                        "a save that also persists blocks training",
                        "s",
                        {
                            "phalanx flash": "results.phalanx.persist_blocking_s",
                            "DLRover flash": "results.dlrover.disk_blocking_s",
                        },
                    ),
                    Row(
                        "save until it is on disk",
                        "s",
                        {
                            "phalanx flash": "results.phalanx.persist_s",
                            "dcp.async_save": "results.dcp_async.total_s",
                        },
                    ),
                    *rows(
                        "results.phalanx.{key}",
                        {"phalanx flash": ""},
                        ("load from memory", "s", "load_from_memory_s"),
                        ("load from memory into the live state", "s", "load_from_memory_in_place_s"),
                        ("load from storage", "s", "load_from_storage_s"),
                    ),
                ),
            ),
            Table(
                "in a training loop, per iteration (one run with DLRover's)",
                ("no checkpoint", *SAVERS_IN_TRAINING),
                ratio=("phalanx flash", "DLRover flash"),
                runs=tuple(
                    Run(f"results.dlrover.in_training.threads_{n}", "torch threads: {threads}, batch {batch}")
                    for n in (1, 2, 15, 16)
                ),
                rows=(
                    Row(
                        "iteration",
                        "s",
                        {
                            "no checkpoint": "{run}.iteration_without_save_s",
                            **across("{run}.{arm}.iteration_s", SAVERS_IN_TRAINING),
                        },
                    ),
                    *rows(
                        "{run}.{arm}.{key}",
                        SAVERS_IN_TRAINING,
                        ("training time the save costs", "s", "stall_s"),
                        ("training waits in the save", "s", "blocking_s"),
                    ),
                ),
            ),
            Table(
                "phalanx's first save of a job",
                tuple(FIRST_SAVE),
                units={"/ the steady save beside it": "x"},
                runs=(
                    Run("results.phalanx"),
                    *(Run(f"after_{n}_steps", f"after {n} training steps") for n in (3, 6)),
                ),
                rows=(
                    *rows(
                        "{run}.{key}_{arm}",
                        FIRST_SAVE,
                        ("at once, nothing prepared", "s", "first_unprepared"),
                        ("slots readied from the optimizer", "s", "first_from_optimizer"),
                        ("after prepare()", "s", "first"),
                        ("after a restart", "s", "first_restarted"),
                    ),
                    *rows("{run}.{key}_blocking_s", {"blocks training": ""}, AT_ONCE[0]),
                    *rows(
                        "{run}.{key}_{arm}",
                        FIRST_SAVE,
                        ("after a load from storage", "s", "first_after_storage_load"),
                    ),
                    *rows("{run}.{key}_blocking_s", {"blocks training": ""}, AT_ONCE[1]),
                ),
            ),
            Table(
                "phalanx's storage, median",
                tuple(STORAGES),
                ratio=("S3 (MinIO over loopback)", "local disk"),
                rows=rows(
                    "{arm}.{key}",
                    STORAGES,
                    ("save blocks training", "s", "blocking_s"),
                    ("a save that persists blocks training", "s", "persist_blocking_s"),
                    ("save until it is on storage", "s", "persist_s"),
                    ("load from storage", "s", "load_from_storage_s"),
                ),
            ),
        ),
    ),
    Family(
        "dcp",
        "DCP over the flash checkpoint",
        setup=(
            Fact("state", "B", "size_bytes"),
            Fact("torch threads", "", "torch_threads"),
            Fact("load average before", "", "load_average_before"),
        ),
        tables=(
            Table(
                "save method",
                tuple(VALUE),
                by_run=True,
                runs=(
                    Run("results.flash_async", "dcp.async_save into the flash checkpoint (FlashWriter)"),
                    Run("results.flash_async_persist", "the same, persisted"),
                    Run("results.flash_sync", "dcp.save into the flash checkpoint"),
                    Run("results.checkpointer_save", "the flash checkpoint without DCP"),
                    Run("results.fs_async", "dcp.async_save to disk (DCP's default)"),
                    Run("results.fs_async_kept_stager", "dcp.async_save to disk, one stager kept"),
                    Run("results.copy_floor", "a copy into memory touched before (the floor)"),
                ),
                rows=rows(
                    "{run}.{key}",
                    VALUE,
                    ("blocks training, median", "s", "blocking_s"),
                    ("least it blocked", "s", "min_blocking_s"),
                    ("first save blocks", "s", "first_blocking_s"),
                    ("until done", "s", "total_s"),
                ),
            ),
            Table(
                "load",
                ("flash checkpoint, from memory", "DCP, from the page cache"),
                ratio=("flash checkpoint, from memory", "DCP, from the page cache"),
                rows=(
                    Row(
                        "load",
                        "s",
                        {
                            "flash checkpoint, from memory": "loads.flash_memory_s",
                            "DCP, from the page cache": "loads.fs_page_cache_s",
                        },
                    ),
                ),
            ),
        ),
    ),
    Family(
        "master_capacity",
        "Master capacity: heartbeats one master answers on one core",
        setup=(
            Fact("nodes", "", "saturated.nodes"),
            Fact("calls or streams in flight when saturated", "", "saturated.concurrency"),
            Fact("seconds per phase", "s", "saturated.seconds"),
            Fact("saturated phases repeated", "", "repeat"),
        ),
        tables=(
            Table(
                "saturated: as fast as the master answers",
                tuple(SATURATED),
                ratio=("phalanx, streams", "before the change, streams"),
                rows=rows("{arm}.{key}", SATURATED, *HEARTBEATS),
            ),
            Table(
                "every node heartbeating once a second",
                tuple(PACED),
                ratio=("streams, held (the agents' way)", "unary, held"),
                rows=rows("{arm}.{key}", PACED, *HEARTBEATS),
            ),
        ),
    ),
    Family(
        "operator_api_load",
        "Operator load on the Kubernetes API server",
        tables=(
            Table(
                "operator",
                tuple(VALUE),
                by_run=True,
                runs=tuple(Run(f"runs.{i}", "{operator}") for i in range(4)),
                rows=rows(
                    "{run}.{key}",
                    VALUE,
                    ("jobs", "", "jobs"),
                    ("operator requests per job", "/min", "requests_per_job_per_minute"),
                    ("all operator requests", "/min", "operator_requests_per_minute"),
                    ("masters' requests per job", "/min", "masters.requests_per_job_per_minute"),
                    ("goal per job", "/min", "goal_per_job_per_minute"),
                    ("to create every Pod", "s", "seconds_to_create_all_pods"),
                ),
            ),
        ),
    ),
    Family(
        "fleet_sim",
        "Scale by simulation",
        setup=(
            Fact("nodes", "", "setup.nodes"),
            Fact("GPUs per node", "", "setup.gpus_per_node"),
            Fact("spares", "", "setup.spares"),
            Fact("simulated", "days", "setup.simulated_days"),
            Fact("fleet MTBF", "h", "setup.fleet_mtbf_h"),
            Fact("failures", "", "decisions.failures"),
            Fact("step", "s", "setup.step_s"),
        ),
        tables=(
            Table(
                "goodput over the simulated failures",
                tuple(FLEET),
                ratio=("phalanx", "torchrun (restarts the whole job)"),
                runs=tuple(
                    Run(f"goodput_by_interval.interval_{m}min", f"a checkpoint every {m} min")
                    for m in (10, 30, 60)
                ),
                rows=rows(
                    "{run}.{arm}.{key}",
                    FLEET,
                    ("goodput", "share", "goodput"),
                    ("hours lost", "h", "lost_hours"),
                    ("per failure: detect, mean", "s", "detect_s_mean"),
                    ("re-form, mean", "s", "reform_s_mean"),
                    ("restore, mean", "s", "restore_s_mean"),
                    ("recompute, mean", "s", "recompute_s_mean"),
                    ("in all, mean", "s", "total_s_mean"),
                ),
            ),
            Table(
                "rendezvous",
                tuple(VALUE),
                by_run=True,
                runs=(
                    *(Run(f"rendezvous_core.{n}", "{key} nodes, the core's CPU time") for n in (1000, 4096)),
                    Run("rendezvous_grpc", "{nodes} nodes over gRPC"),
                    Run("rendezvous_grpc.baseline", "the same, before the change ({source})"),
                ),
                rows=rows(
                    "{run}.{key}",
                    VALUE,
                    ("register and join until formed", "s", "register_and_join_to_formed_cpu_s"),
                    ("every member's answer", "s", "answers_cpu_s"),
                    ("until every agent holds the round", "s", "median_all_hold_formed_round_s"),
                    ("master CPU", "s", "median_master_cpu_s"),
                ),
            ),
            Table(
                "per failure, the core's CPU time",
                tuple(PERCENTILES),
                rows=rows(
                    "decisions.{key}.{arm}",
                    PERCENTILES,
                    ("failure → decision", "ms", "decision_cpu_ms"),
                    ("failure → round formed", "ms", "to_formed_cpu_ms"),
                    ("every member's answer", "ms", "answers_cpu_ms"),
                ),
            ),
        ),
    ),
    Family(
        "foldin",
        "Folding a replacement node in",
        setup=(
            Fact("nodes", "", "setup.nodes"),
            Fact("step", "s", "setup.step_time_s"),
            Fact("node killed at step", "", "setup.kill_node_at_step"),
            Fact("heartbeat timeout", "s", "setup.heartbeat_timeout_s"),
        ),
        tables=(
            Table(
                "kill → the replacement's first step, median",
                tuple(FOLD_IN),
                ratio=("train on, fold in (phalanx)", "wait for the replacement"),
                rows=(
                    *rows("median.{arm}_lost_median_s", FOLD_IN, ("full-world training lost", "s", "")),
                    Row(
                        "gained by training on",
                        "s",
                        {"train on, fold in (phalanx)": "median.train_on_gain_median_s"},
                    ),
                ),
            ),
            Table(
                "the run, median",
                ("median",),
                rows=rows(
                    "median.{key}",
                    {"median": ""},
                    ("step at the full world", "s", "t3_median_s"),
                    ("step at the smaller world", "s", "t2_median_s"),
                    ("kill → first step of the survivors", "s", "reform_median_s"),
                    ("survivors trained alone", "s", "world2_median_s"),
                    ("steps they trained", "", "world2_steps_median"),
                    ("fold-in: round opened → first step", "s", "fold_in_cost_median_s"),
                    ("of which gathering the survivors", "s", "fold_in_gather_median_s"),
                    ("of which restarting", "s", "fold_in_restart_median_s"),
                    ("steps trained again after it", "", "fold_in_lost_median"),
                ),
            ),
        ),
    ),
    Family(
        "regroup",
        "Regroup after a node loss",
        setup=(
            Fact("runs", "", "runs"),
            Fact("phalanx local's heartbeats", "text", "settings.local"),
            Fact("its default heartbeats", "text", "settings.local-default"),
        ),
        tables=(
            Table(
                "node SIGKILL, median of runs",
                tuple(REGROUP),
                ratio=("in-process regroup", "torchrun"),
                runs=(
                    Run("kill_to_next_step"),
                    Run("before_the_change", "before the change"),
                    Run("before", "before the change"),
                    Run("after_held_heartbeats", "held heartbeats"),
                    Run("after_reformed_round", "held heartbeats and a re-formed round"),
                ),
                rows=rows(
                    "{run}.{arm}.{key}",
                    REGROUP,
                    ("kill → next completed step", "s", "median_s"),
                    ("attempts", "", "attempts"),
                ),
            ),
            Table(
                "steady training, one launcher each",
                tuple(LAUNCHERS),
                ratio=("phalanx-run", "torchrun"),
                rows=(
                    *rows(
                        "overhead.{key}{arm}_steps_per_s",
                        LAUNCHER_OVERHEAD,
                        ("steps per second, median of pairs", "/s", ""),
                        ("steps per second, whole run", "/s", "whole_run."),
                    ),
                    *rows(
                        "overhead.{key}.{arm}_median",
                        LAUNCHER_CPU,
                        ("the launcher's share of the CPU", "share", "launcher_cpu_share"),
                    ),
                    *rows(
                        "overhead.{key}.{arm}_median_s", LAUNCHER_CPU, ("CPU per step", "s", "cpu_s_per_step")
                    ),
                ),
            ),
        ),
    ),
    Family(
        "probes",
        "Health-probe start-up",
        setup=(
            Fact("measuring", "s", "matmul_seconds"),
            Fact("the capped node's CPU", "cores", "results.cpu_capped.cpus"),
            Fact("runs", "", "results.idle.runs"),
        ),
        tables=(
            Table(
                "one probe, median",
                tuple(PROBES),
                ratio=("warm probe (phalanx)", "cold probe"),
                runs=(Run("results.idle", "idle node"), Run("results.cpu_capped", "CPU-capped node")),
                rows=(
                    *rows(
                        "{run}.{arm}_{key}",
                        PROBES,
                        ("request → measurements", "s", "s"),
                        ("beyond the measuring itself", "s", "overhead_s"),
                    ),
                    Row("the warm server's first probe", "s", {"warm probe (phalanx)": "{run}.first_warm_s"}),
                ),
            ),
        ),
    ),
    Family(
        "stragglers",
        "Straggler detection from step times",
        setup=(
            Fact("workload", "text", "workload"),
            Fact("step", "s", "step_time_s"),
            Fact("fault after", "s", "fault_after_s"),
            Fact("given up after", "s", "give_up_s"),
        ),
        tables=(
            Table(
                "slow-cpu fault on one of two nodes",
                tuple(STRAGGLERS),
                runs=(
                    Run("results.half_of_healthy", "slow node at {cpu} CPU, the other at {healthy_cpu}"),
                    Run("results.half", "slow node at {cpu} CPU, the other {healthy_cpu}"),
                ),
                rows=rows(
                    "{run}.{arm}.{key}",
                    STRAGGLERS,
                    ("fault → flagged, median", "s", "median_time_to_flag_s"),
                    ("fastest", "s", "min_time_to_flag_s"),
                    ("slowest", "s", "max_time_to_flag_s"),
                    ("runs flagged", "", "flagged"),
                    ("runs", "", "runs"),
                    ("slow node's step / the others', median", "x", "median_relative_score"),
                    null="not flagged",
                ),
            ),
        ),
    ),
    Family(
        "plain_hang",
        "Hang of an unmodified script",
        setup=(Fact("phalanx's timeouts", "text", "goal_s"), Fact("given up after", "s", "give_up_s")),
        tables=(
            Table(
                "hang → caught, median",
                tuple(LAUNCHERS),
                ratio=("phalanx-run", "torchrun"),
                rows=rows(
                    "headline.{arm}_{key}_s_median",
                    LAUNCHERS,
                    ("a rank SIGSTOPped", "s", "sigstop"),
                    ("a rank that never enters the collective", "s", "never_entered"),
                    null="not caught",
                ),
            ),
        ),
    ),
    Family(
        "hang_blame",
        "Blame for a hang",
        setup=(Fact("job", "text", "setup"), Fact("runs", "", "summary.runs")),
        tables=(
            Table(
                "one rank SIGSTOPped",
                tuple(HANG_BLAME),
                rows=(
                    Row(
                        "runs the hang was counted against it",
                        "",
                        {
                            "the stopped node": "summary.counted_against_the_stopped_node",
                            "its peer (the victim)": "summary.counted_against_the_victim",
                        },
                    ),
                    Row(
                        "runs it reported the hang first",
                        "",
                        {"its peer (the victim)": "summary.reported_first_by_the_victim"},
                    ),
                    *rows(
                        "summary.{arm}_{key}",
                        HANG_BLAME,
                        ("CPU used while the rank was stopped, median", "ms/s", "cpu_ms_per_s_median"),
                        compare=False,
                    ),
                ),
            ),
        ),
    ),
    Family(
        "gpu_hang",
        "Device-side hang on a GPU",
        setup=(Fact("hang timeout", "s", "timeout_s"), Fact("torch", "text", "torch")),
        tables=(
            Table(
                "a kernel spinning before an all-reduce",
                ("phalanx local",),
                rows=rows(
                    "summary.{key}",
                    {"phalanx local": ""},
                    ("spin → hang detected, median", "s", "detected_after_s_median"),
                    ("fastest; slowest", "s", "detected_after_s_range"),
                    ("verdicts: device side", "", "device_side_verdicts"),
                    ("with the NCCL flight recorder", "", "with_flight_recorder"),
                    ("training resumed", "", "resumed"),
                    ("runs", "", "runs"),
                ),
            ),
        ),
    ),
    Family(
        "gpu_intervals",
        "The interval recorder on a GPU",
        setup=(
            Fact("matmuls per step", "", "overhead.matmuls_per_step"),
            Fact("matrix size", "", "overhead.size"),
            Fact("runs per arm", "", "overhead.runs"),
            Fact("steps per run", "", "overhead.steps_per_run"),
            Fact("torch", "text", "torch"),
        ),
        tables=(
            Table(
                "bf16 matmul loop",
                tuple(RECORDER),
                ratio=("with the recorder", "without the recorder"),
                rows=(
                    *rows("overhead.median_{arm}", RECORDER, ("steps per second, median", "/s", "")),
                    *rows(
                        "overhead.{key}",
                        {"with the recorder": ""},
                        ("overhead", "%", "overhead_pct"),
                        ("goal, at most", "%", "goal_pct"),
                        compare=False,
                    ),
                ),
            ),
            Table(
                "device-side hang",
                ("recorder",),
                rows=rows(
                    "device_hang.{key}",
                    {"recorder": ""},
                    ("kernel launched → hang detected", "s", "detected_after_launch_s"),
                    ("timeout", "s", "timeout_s"),
                    ("the host's call returned after", "s", "host_returned_after_s"),
                    ("verdict's side", "text", "side"),
                ),
            ),
        ),
    ),
    Family(
        "recorder_overhead",
        "The interval recorder on CPU",
        setup=(
            Fact("cores", "", "cpus"),
            Fact("load average", "", "load_avg_1m"),
            Fact("torch", "text", "torch"),
            Fact("hang timeout", "s", "detection.0.timeout_s"),
        ),
        tables=(
            Table(
                "one record, median",
                tuple(RECORD_COST),
                ratio=("C write path", "Python write path"),
                rows=rows(
                    "record_cost.{arm}{key}",
                    RECORD_COST,
                    ("step boundary", "ns", "step_boundary_ns"),
                    ("collective begin and end", "ns", "collective_ns"),
                    ("a with collective(...) block", "ns", "collective_with_ns"),
                ),
            ),
            Table(
                "MLP width",
                tuple(VALUE),
                by_run=True,
                runs=tuple(Run(f"overhead.{i}", "hidden {hidden}") for i in range(3)),
                rows=rows(
                    "{run}.{key}",
                    VALUE,
                    ("step", "ms", "step_ms"),
                    ("steps/s without", "/s", "median_without"),
                    ("steps/s with", "/s", "median_with"),
                    ("overhead, wall", "%", "overhead_pct"),
                    ("overhead, CPU", "%", "cpu_overhead_pct"),
                    ("instrumented, recorder off", "%", "overhead_pct.instrumented_off"),
                    ("Python write path", "%", "overhead_pct.python"),
                    ("C write path", "%", "overhead_pct.c"),
                ),
            ),
            Table(
                "the recorder before a change and after",
                (*BEFORE_AFTER, PAIRED),
                units={PAIRED: "x"},
                rows=(
                    *(
                        Row(label, "ns", {**across(f"summary.{{arm}}.{key}", BEFORE_AFTER), PAIRED: paired})
                        for label, key, paired in (
                            ("step boundary", "step_boundary_ns", "local_paired_ab.step_boundary"),
                            (
                                "collective begin and end",
                                "collective_ns",
                                "local_paired_ab.collective_begin_end",
                            ),
                            (
                                "a with collective(...) block",
                                "collective_with_ns",
                                "local_paired_ab.collective_with_block",
                            ),
                        )
                    ),
                    *rows(
                        "summary.{arm}.{key}.overhead_pct_paired_median",
                        BEFORE_AFTER,
                        ("overhead at hidden 256, paired median", "%", "hidden_256"),
                        ("overhead at hidden 1024, paired median", "%", "hidden_1024"),
                    ),
                    *rows(
                        "summary.hidden_256_{arm}_overhead_median_pct_{key}",
                        BEFORE_AFTER,
                        ("overhead at hidden 256, CPU, median of runs", "%", "cpu"),
                        ("overhead at hidden 256, wall, median of runs", "%", "wall"),
                    ),
                    *rows(
                        "summary.hooks_per_step_us_median_{arm}",
                        BEFORE_AFTER,
                        ("the hooks in the loop, per step", "µs", ""),
                    ),
                ),
            ),
            Table(
                "hang under phalanx local, default settings",
                ("a rank SIGSTOPped", "a rank that never enters the collective"),
                rows=rows(
                    "detection.0.{arm}.detected_after_s",
                    {
                        "a rank SIGSTOPped": "sigstop",
                        "a rank that never enters the collective": "never_entered",
                    },
                    ("hang → detected", "s", ""),
                ),
            ),
        ),
    ),
    Family(
        "instrument_overhead",
        "phalanx-run's default instrumentation",
        setup=(Fact("goal, at most", "%", "goal_pct"), Fact("native writer", "", "native_writer")),
        tables=(
            Table(
                "MLP",
                tuple(VALUE),
                by_run=True,
                runs=tuple(Run(f"widths.{i}", "hidden {hidden}, {optimizer}") for i in range(2)),
                rows=rows(
                    "{run}.{key}",
                    VALUE,
                    ("step", "ms", "step_ms"),
                    ("overhead, CPU", "%", "overhead_pct"),
                    ("overhead, wall", "%", "wall_overhead_pct"),
                    ("c10d hooks every step (before the lookout), CPU", "%", "every_step_overhead_pct"),
                    ("c10d hooks every step (before the lookout), wall", "%", "every_step_wall_overhead_pct"),
                ),
            ),
        ),
    ),
    Family(
        "isolation",
        "Fault isolation of slow nodes",
        setup=(Fact("fault at", "s", "fault_at_s"), Fact("steps", "", "steps")),
        tables=(
            Table(
                "one slow node of three, median of runs",
                tuple(ISOLATION),
                ratio=("probes, confirmed twice (default)", "no probes (as torchrun)"),
                runs=(
                    Run("results.slow-cpu", "slow CPU"),
                    Run("results.slow-network", "slow network"),
                    Run("results.healthy", "no fault"),
                    Run("false_evictions_slow_network", "slow network, more runs"),
                ),
                rows=rows(
                    "{run}.{arm}.{key}",
                    ISOLATION,
                    ("fault → slow node evicted", "s", "eviction_s"),
                    ("fault → training again", "s", "recovery_s"),
                    ("steps/s before the fault", "/s", "steps_per_s_before"),
                    ("steps/s after it", "/s", "steps_per_s_after"),
                    ("runs that evicted the slow node", "", "evicted_the_slow_node"),
                    ("evictions of nodes that were not slow", "", "false_evictions"),
                    ("runs", "", "runs"),
                    null="never",
                ),
            ),
        ),
    ),
    Family(
        "host_failover",
        "Checkpoint host failover",
        setup=(
            Fact("a save every", "s", "save_every_s"),
            Fact("persist every", "saves", "persist_every"),
            Fact("state", "B", "state_bytes"),
        ),
        tables=(
            Table(
                "the node's checkpoint host, median of runs",
                tuple(HOST_FAULTS),
                rows=rows(
                    "results.{arm}.{key}",
                    HOST_FAULTS,
                    ("fault → a new host answers", "s", "replaced_s"),
                    ("longest a save blocked training", "s", "worst_save_s"),
                    ("persist errors training caught", "", "persist_errors"),
                    ("fault → first step committed", "s", "committed_after_s"),
                ),
            ),
        ),
    ),
    Family(
        "shard_loss",
        "Loss of a whole shard",
        tables=(
            Table(
                "median of runs",
                tuple(NOW_BEFORE),
                ratio=("now", "before the change"),
                runs=(
                    Run("kill-node", "node killed: its shard read from storage"),
                    Run("kill-worker", "worker killed: its shard in the node's memory"),
                ),
                rows=rows(
                    "{arm}{run}.{key}",
                    NOW_BEFORE,
                    ("fault → training again", "s", "median_recovered_s"),
                    ("steps trained again", "", "median_steps_lost"),
                ),
            ),
            Table(
                "runs",
                tuple(NOW_BEFORE),
                rows=rows("{arm}failed_runs", NOW_BEFORE, ("whose job failed", "", "")),
            ),
        ),
    ),
    Family(
        "containers",
        "Containers against processes",
        tables=(
            Table(
                "the same ElasticJob, median of runs",
                tuple(CLUSTERS),
                ratio=("containers", "processes"),
                rows=rows(
                    "median.{arm}.{key}",
                    CLUSTERS,
                    ("ElasticJob created → first step", "s", "start_s"),
                    ("worker killed → next step", "s", "worker_kill_s"),
                    ("node lost → next step", "s", "node_loss_s"),
                    ("steps trained again after the worker kill", "", "steps_lost"),
                    ("steps trained again after the node loss", "", "node_loss_steps_lost"),
                ),
            ),
        ),
    ),
    Family(
        "timeline",
        "The master's interval timeline",
        tables=(
            Table(
                "the master at its bound",
                ("master",),
                rows=rows(
                    "master.{key}",
                    {"master": ""},
                    ("ranks", "", "ranks"),
                    ("intervals kept", "", "kept_intervals"),
                    ("memory traced", "MiB", "traced_mib"),
                    ("per interval", "bytes", "bytes_per_interval"),
                    ("RSS growth", "MiB", "rss_growth_mib"),
                    ("one node's beat into a full timeline, median", "ms", "beat_8x256_ms_median"),
                    ("the same, slowest", "ms", "beat_8x256_ms_max"),
                    ("intervals in GET /v1/timeline's answer", "", "answer_intervals"),
                    ("building that answer", "s", "answer_build_s"),
                    ("its JSON", "s", "answer_json_s"),
                ),
            ),
            Table(
                "phalanx timeline",
                ("CLI",),
                rows=rows(
                    "cli.{key}",
                    {"CLI": ""},
                    ("ranks", "", "ranks"),
                    ("intervals", "", "intervals"),
                    ("the trace", "s", "trace_s"),
                    ("its size", "MiB", "trace_mib"),
                    ("the PNG", "s", "png_s"),
                    ("its size", "KiB", "png_kib"),
                ),
            ),
        ),
    ),
)
