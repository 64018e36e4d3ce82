"""Which processes are ranks of one job, from what each was started with.

A distributed job's ranks are separate processes, and what a user asks of them is asked of the job:
a data-parallel step ends with a collective that waits for every rank, so the job runs at its slowest
rank's pace. The ranks are told apart by the environment their launcher gives them (read from
/proc/PID/environ, what each process was started with), in this order:

    torchrun / torchelastic   TORCHELASTIC_RUN_ID, RANK, WORLD_SIZE
    MPI (Open MPI, PMIx)      OMPI_COMM_WORLD_RANK / _SIZE, PMIX_NAMESPACE or OMPI_MCA_orte_ess_jobid
    Slurm                     SLURM_JOB_ID and SLURM_STEP_ID, SLURM_PROCID, SLURM_NTASKS
    torch.distributed         MASTER_ADDR and MASTER_PORT, RANK, WORLD_SIZE (any launcher)
    gputrace run              GPUTRACE_JOB (every process a `gputrace run` started, and their children)

A key seen on one process only is no job: the process is shown alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from gputrace.base.procs import environ


@dataclass(frozen=True)
class JobTag:
    """Empty key: the process is no rank of a job known here. rank and world: None where not said."""

    key: str = ""
    rank: int | None = None
    world: int | None = None


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def from_environ(env: Mapping[str, str]) -> JobTag:
    rank, world = _int(env.get("RANK")), _int(env.get("WORLD_SIZE"))
    if env.get("TORCHELASTIC_RUN_ID"):
        return JobTag(f"torchrun {env['TORCHELASTIC_RUN_ID']}", rank, world)
    if env.get("OMPI_COMM_WORLD_RANK") is not None:
        ns = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_orte_ess_jobid") or "?"
        return JobTag(f"mpi {ns}", _int(env.get("OMPI_COMM_WORLD_RANK")), _int(env.get("OMPI_COMM_WORLD_SIZE")))
    if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID") is not None:
        return JobTag(f"slurm {env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}", _int(env.get("SLURM_PROCID")),
                      _int(env.get("SLURM_NTASKS")))
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT") and world is not None:
        return JobTag(f"torch.distributed {env['MASTER_ADDR']}:{env['MASTER_PORT']}", rank, world)
    if env.get("GPUTRACE_JOB"):
        return JobTag(f"gputrace run {env['GPUTRACE_JOB']}")
    return JobTag()


def job_tag(pid: int) -> JobTag:
    """The job a running process is a rank of; JobTag() where it says none (or cannot be read)."""
    return from_environ(environ(pid))
