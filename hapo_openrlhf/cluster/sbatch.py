"""Render an sbatch script from a run config (one source of truth) and submit it.

Everything the script needs comes from the run config or the ``hapo submit`` flags; the
script repeats no config value by hand. Node and GPU counts given on the command line
are passed back to the job as ``--set`` overrides (``openrlhf.actor_num_nodes`` ...), so
the allocation and the training layout cannot disagree.
"""

from __future__ import annotations

import json
import re
import shlex
import string
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..config import RunConfig, load_config
from .netif import check_name

TEMPLATE = Path(__file__).with_name("templates") / "hapo.sbatch"  # slurm/hapo.sbatch links here
QUADRANTS = ("PHR", "PLR", "NHR", "NLR")


@dataclass(frozen=True)
class SubmitOptions:
    nodes: int | None = None  # default: openrlhf.actor_num_nodes (openrlhf) or 1
    gpus_per_node: int | None = None  # default: the actors' GPUs (+ vLLM's when not colocated), or 0 (local)
    cpus_per_task: int | None = None
    partition: str | None = None
    account: str | None = None
    time: str = "24:00:00"
    signal_seconds: int | None = None  # USR1 this long before the time limit; None: the config's (signal_lead_seconds)
    max_requeues: int = 20
    ray_port: int = 6379
    ray_timeout_s: int = 300
    array: str | None = None  # "seeds=1,2,3" or "quadrants"
    output_dir: str | None = None
    ray_check: bool = False  # bring Ray up on every node and report, no training
    ray_num_gpus: int | None = None  # GPUs each Ray node advertises and must register (default: the allocation's)
    network_interface: str | None = None  # every node's Ray / gloo / NCCL interface (e.g. ib0; netif.py)
    sets: tuple[str, ...] = ()
    extra_sbatch: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self):
        def count(flag, v, lo, hi=None):
            if v is None:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
                raise ValueError(f"{flag} must be an integer {rng}, got {v!r}")

        count("--nodes", self.nodes, 1)
        count("--gpus-per-node", self.gpus_per_node, 0)
        count("--cpus-per-task", self.cpus_per_task, 1)
        count("--signal-seconds", self.signal_seconds, 1, 65535)  # Slurm's limit for --signal
        count("--max-requeues", self.max_requeues, 0)
        count("--ray-port", self.ray_port, 1024, 65535)
        count("--ray-timeout", self.ray_timeout_s, 1)
        count("--ray-num-gpus", self.ray_num_gpus, 0)
        if self.network_interface is not None:
            check_name(self.network_interface)  # a name, or a named error (it reaches a shell script)
        time_limit_seconds(self.time)  # a Slurm time, or a named error
        if self.partition is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*", self.partition):
            raise ValueError(f"--partition {self.partition!r} is not a Slurm partition name (or a comma-separated "
                             f"list): letters, digits, '_', '.', '-'")
        if self.account is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", self.account):
            raise ValueError(f"--account {self.account!r} is not a Slurm account name: letters, digits, '_', '.', '-'")
        if self.output_dir is not None:
            check_path("--output-dir", self.output_dir)
        for kv in self.sets:
            _no_control("--set", kv)
        for d in self.extra_sbatch:
            check_extra_sbatch(d)


# options the rendered script sets itself: an extra --sbatch may not change them
_OWN_OPTIONS = {"job-name", "J", "nodes", "N", "ntasks-per-node", "cpus-per-task", "c", "time", "t", "output", "o",
                "error", "e", "open-mode", "requeue", "no-requeue", "signal", "gpus-per-node", "partition", "p",
                "account", "A", "array", "a", "wrap", "chdir", "D"}


# sbatch's long options (Slurm 22.05's `sbatch --help`, plus those it takes without listing them).
# sbatch parses options -- #SBATCH lines too -- with getopt_long, which accepts any unambiguous
# abbreviation (`--outp=` is `--output=`): a name that is not one of these exactly is an
# abbreviation, and one that abbreviates an option the script sets is refused.
_SBATCH_LONG = frozenset("""
    account acctg-freq array batch bb bbf begin chdir cluster-constraint clusters comment constraint container
    contiguous core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task deadline delay-boot dependency
    distribution error exclude exclusive export export-file extra-node-info get-user-env gid gpu-bind gpu-freq
    gpus gpus-per-node gpus-per-socket gpus-per-task gres gres-flags help hint hold ignore-pbs input job-name
    kill-on-invalid-dep licenses mail-type mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu mincpus
    network nice no-kill no-requeue nodefile nodelist nodes ntasks ntasks-per-core ntasks-per-gpu
    ntasks-per-node ntasks-per-socket open-mode output overcommit oversubscribe parsable partition power
    priority profile propagate qos quiet reboot requeue reservation signal sockets-per-node spread-job
    switches test-only thread-spec threads-per-core time time-min tmp uid usage use-min-nodes verbose version
    wait wait-all-nodes wckey wrap
""".split())


def time_limit_seconds(time: str) -> int:
    """Slurm's ``--time`` forms (minutes, minutes:seconds, hours:minutes:seconds, days-hours,
    days-hours:minutes, days-hours:minutes:seconds) in seconds; ASCII digits only; 0 means
    no limit, as for Slurm."""
    bad = ValueError(f"--time {time!r} is not a Slurm time (e.g. 24:00:00 or 2-00:00:00)")
    m = re.fullmatch(r"(?:([0-9]+)-)?([0-9]+)((?::[0-9]{2}){0,2})", str(time), flags=re.ASCII)
    if not m:
        raise bad
    days, first, rest = m.group(1), int(m.group(2)), [int(x) for x in m.group(3).split(":")[1:]]
    if days is not None:  # days-hours[:minutes[:seconds]]
        h, mi, se = first, *(rest + [0, 0])[:2]
        secs = int(days) * 86400 + h * 3600 + mi * 60 + se
    elif len(rest) == 2:
        secs = first * 3600 + rest[0] * 60 + rest[1]
    elif len(rest) == 1:
        secs = first * 60 + rest[0]
    else:
        secs = first * 60
    return secs  # 0: no time limit (Slurm's meaning of --time=0)


def sbatch_quote(value: str) -> str:
    """A value for an ``#SBATCH`` line, in double quotes: sbatch's directive parser ends an
    unquoted value at '#' (a comment) and at whitespace, takes a quote as the start of a
    quoted part, and eats backslashes; inside double quotes only '\\' and '"' need escaping."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _no_control(flag: str, value: str) -> None:
    if re.search(r"[\x00-\x1f\x7f]", value):
        raise ValueError(f"{flag} {value!r} contains a control character (a newline would start a new line of "
                         f"the batch script)")


def check_path(flag: str, value: str) -> None:
    """A path that goes into ``#SBATCH`` lines and the command line: one line, no whitespace
    (sbatch splits directives on it) and no '%' (Slurm's file-name patterns)."""
    _no_control(flag, value)
    if re.search(r"\s|%", value):
        raise ValueError(f"{flag} {value!r} contains whitespace or '%', which #SBATCH --output cannot take; "
                         f"choose a path without them")


def check_extra_sbatch(directive: str) -> None:
    """One single-line ``--option[=value]`` per ``--sbatch``, not one the script sets itself."""
    _no_control("--sbatch", directive)
    m = re.fullmatch(r"--([A-Za-z][A-Za-z0-9-]*)(=\S+)?", directive)
    if not m:
        raise ValueError(f"--sbatch {directive!r} must be one option, '--name' or '--name=value' without spaces "
                         f"(one --sbatch per option)")
    name = m.group(1)
    own = [name] if name in _OWN_OPTIONS else (
        [] if name in _SBATCH_LONG else sorted(o for o in _OWN_OPTIONS if len(o) > 1 and o.startswith(name)))
    if own:
        what = f"--{name}" if own == [name] else f"--{name} abbreviates --{own[0]}, which"
        raise ValueError(f"--sbatch {directive!r}: {what} is set by hapo submit itself; use its own flag "
                         f"(--nodes, --time, --partition, --account, --output-dir, --array, ...)")


def array_overrides(spec: str | None) -> list[dict]:
    """One ``{"suffix", "sets"}`` per array task: ``seeds=1,2,3`` or ``quadrants`` (PHR, PLR, NHR, NLR).
    Task i trains with the extra ``sets`` into ``OUTPUT_DIR/<suffix>``."""
    if not spec:
        return []
    if spec == "quadrants":
        return [{"suffix": q.lower(), "sets": ["algorithm.estimator=quadrant",
                                               f"algorithm.estimator_params={{quadrants: [{q}]}}"]} for q in QUADRANTS]
    m = re.fullmatch(r"seeds=([0-9]+(?:,[0-9]+)*)", spec, flags=re.ASCII)
    if m:
        seeds = [int(s) for s in m.group(1).split(",")]
        dup = sorted({s for s in seeds if seeds.count(s) > 1})
        if dup:
            raise ValueError(f"--array {spec!r} repeats seed(s) {dup}: two array tasks would train into one "
                             f"directory")
        return [{"suffix": f"seed{s}", "sets": [f"seed={s}"]} for s in seeds]
    raise ValueError(f"--array must be 'seeds=1,2,3' or 'quadrants', got {spec!r}")


def model_size_billions(path: str | None) -> float | None:
    """Parameters in billions from a model name ("Qwen2.5-Math-7B" -> 7.0), if it says."""
    m = re.search(r"(?<![\d.])(\d+(?:\.\d+)?)[Bb](?![a-zA-Z])", Path(path or "").name)
    return float(m.group(1)) if m else None


def signal_lead_seconds(cfg: RunConfig) -> int:
    """How long before the time limit Slurm sends USR1: the step in flight must finish and
    checkpoint in that time. ``slurm.signal_lead_s`` if set; else 1.5 x ``slurm.expected_step_s``
    + 300 s; else 300 s for the embedded trainer and, for the cluster back ends, 300 s plus
    0.075 s per response token, scaled by the model size over 7B (at least 1): 530 s for
    Qwen2.5-Math-7B at 3k, 2,143 s (> 30 min) at 24k."""
    s = cfg.slurm
    if s.signal_lead_s is not None:
        return int(s.signal_lead_s)
    if s.expected_step_s is not None:
        return int(1.5 * s.expected_step_s + 300)
    if cfg.backend == "local":
        return 300
    size = max(1.0, (model_size_billions(cfg.model.path) or 7.0) / 7.0)
    return int(300 + 0.075 * cfg.rollout.max_new_tokens * size)


def vllm_gpus_per_node(cfg: RunConfig, nodes: int) -> int:
    """GPUs per node the vLLM engines need beside the actors (0 when colocated)."""
    o = cfg.openrlhf
    if o.colocate_all:
        return 0
    return -(-o.vllm_num_engines * o.vllm_tensor_parallel_size // nodes)


def default_gpus_per_node(cfg: RunConfig) -> int:
    if cfg.backend not in ("openrlhf", "megatron"):
        return 0
    o = cfg.openrlhf
    return o.actor_gpus_per_node + vllm_gpus_per_node(cfg, o.actor_num_nodes)


def layout_overrides(cfg: RunConfig, nodes: int, gpus: int) -> list[str]:
    """Overrides that make the training layout match the allocation: colocated, the
    actors take every GPU and one vLLM engine runs per ``vllm_tensor_parallel_size`` of
    them; otherwise the engines keep their count and the actors take the rest."""
    if cfg.backend not in ("openrlhf", "megatron"):
        return []
    o = cfg.openrlhf
    actor_gpus = gpus - vllm_gpus_per_node(cfg, nodes)
    if actor_gpus < 1:
        raise ValueError(f"{gpus} GPUs per node leave none for the actors: the {o.vllm_num_engines} vLLM engines "
                         f"x TP {o.vllm_tensor_parallel_size} need {vllm_gpus_per_node(cfg, nodes)} per node "
                         f"(openrlhf.colocate_all is false)")
    out = [f"openrlhf.actor_num_nodes={nodes}", f"openrlhf.actor_gpus_per_node={actor_gpus}"]
    if o.colocate_all:  # one vLLM engine per vllm_tensor_parallel_size GPUs of the actor allocation
        out.append(f"openrlhf.vllm_num_engines={max(nodes * gpus // o.vllm_tensor_parallel_size, 1)}")
    return out


def render(config: str | Path, opts: SubmitOptions, workdir: str | Path | None = None) -> str:
    config = Path(config).resolve()
    check_path("CONFIG", str(config))
    cfg = load_config(config, list(opts.sets))
    if not re.fullmatch(r"[A-Za-z0-9_.+-]{1,128}", cfg.run_name):
        raise ValueError(f"run_name {cfg.run_name!r} cannot be a Slurm job name: use 1-128 letters, digits, "
                         f"'.', '_', '+', '-'")
    is_orl = cfg.backend in ("openrlhf", "megatron")
    nodes = opts.nodes or (cfg.openrlhf.actor_num_nodes if is_orl else 1)
    gpus = opts.gpus_per_node if opts.gpus_per_node is not None else default_gpus_per_node(cfg)
    if cfg.backend == "local" and nodes > 1 and not opts.ray_check:
        raise ValueError("the local back end runs in one process: --nodes must be 1 (use backend: openrlhf)")
    out = Path(opts.output_dir or cfg.output_dir).resolve()
    check_path("output_dir" if not opts.output_dir else "--output-dir", str(out))
    wd = Path(workdir or Path.cwd()).resolve()
    _no_control("the working directory", str(wd))
    sets = list(opts.sets) + layout_overrides(cfg, nodes, gpus)
    arr = array_overrides(opts.array)
    for task in arr:  # every array task's config must load
        load_config(config, sets + task["sets"])
    directives = []
    if gpus:
        directives.append(f"#SBATCH --gpus-per-node={gpus}")
    if opts.partition:
        directives.append(f"#SBATCH --partition={opts.partition}")
    if opts.account:
        directives.append(f"#SBATCH --account={opts.account}")
    if arr:
        directives.append(f"#SBATCH --array=0-{len(arr) - 1}")
    directives += [f"#SBATCH {d}" for d in opts.extra_sbatch]
    job_args = ["--config", str(config), "--output-dir", str(out), "--max-requeues", str(opts.max_requeues),
                "--ray-port", str(opts.ray_port), "--ray-timeout", str(opts.ray_timeout_s)]
    for s in sets:
        job_args += ["--set", s]
    if arr:
        job_args += ["--array-sets", json.dumps(arr)]
    if opts.ray_check:
        job_args += ["--ray-check"]
    ray_gpus = opts.ray_num_gpus if opts.ray_num_gpus is not None else (gpus or None)
    if ray_gpus is not None and (is_orl or opts.ray_check):
        job_args += ["--ray-num-gpus", str(ray_gpus)]
    if opts.network_interface:
        job_args += ["--network-interface", opts.network_interface]
    log_path = out / ("slurm-%A_%a.out" if arr else "slurm-%j.out")
    lead = opts.signal_seconds if opts.signal_seconds is not None else signal_lead_seconds(cfg)
    limit = time_limit_seconds(opts.time)
    if limit and lead >= limit:
        src = "--signal-seconds" if opts.signal_seconds is not None else "the config's signal lead (slurm.signal_lead_s / " \
                                                                           "expected_step_s, or the response-length estimate)"
        raise ValueError(f"{src} is {lead} s, which does not fit in --time {opts.time} ({limit} s): Slurm would warn "
                         f"the job before it starts a step. Ask for a longer --time, or set slurm.signal_lead_s "
                         f"lower if a step is shorter")
    values = {
        "config": str(config), "job_name": cfg.run_name, "nodes": nodes,
        "cpus_per_task": opts.cpus_per_task or (8 * max(gpus, 1) if gpus else 2),
        "time": opts.time, "log_path": sbatch_quote(str(log_path)),
        "signal_seconds": lead,
        "optional_directives": "\n".join(directives), "workdir": shlex.quote(str(wd)),
        "python": shlex.quote(sys.executable), "job_args": " ".join(shlex.quote(a) for a in job_args),
    }
    return string.Template(TEMPLATE.read_text()).substitute(values)


def submit(script: str, output_dir: str | Path, env: dict | None = None, test_only: bool = False) -> str:
    """``sbatch`` the script (saved next to the run); returns the job id (or sbatch's --test-only message)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "job.sbatch"
    path.write_text(script)
    cmd = ["sbatch", "--test-only" if test_only else "--parsable", str(path)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode:
        raise ValueError(f"sbatch rejected {path}: {p.stderr.strip() or p.stdout.strip()}")
    return (p.stderr + p.stdout).strip() if test_only else p.stdout.strip().split(";")[0]


def output_dir_of(config: str | Path, opts: SubmitOptions) -> Path:
    cfg = load_config(config, list(opts.sets))
    return Path(opts.output_dir or cfg.output_dir).resolve()
