"""Which container and pod a process belongs to, from what the node itself shows.

The cgroup path (/proc/PID/cgroup) names the container runtime and the container, and under
Kubernetes the pod's UID, in the shapes the runtimes write:
    containerd, systemd driver  /kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/cri-containerd-<id>.scope
    CRI-O                       /kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid_>.slice/crio-<id>.scope
    cgroupfs driver             /kubepods/burstable/pod<uid>/<id>
    Docker                      /system.slice/docker-<id>.scope, /docker/<id>
(the systemd driver writes the UID's dashes as underscores). The pod's name is the container's
hostname (Kubernetes sets HOSTNAME to it, unless the pod shares the host's network), its namespace
the service account's namespace file mounted in the container, read through /proc/PID/root. The
workload a pod belongs to is its name without the suffixes its controller generates (a Deployment's
ReplicaSet hash and random suffix, a Job's or DaemonSet's random suffix, a StatefulSet's ordinal): a
guess from the name, labelled as such, where no API server is asked. Prometheus users can join on the
pod UID with kube-state-metrics' kube_pod_info for the real owner.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ID = r"([0-9a-f]{64})"
_UID = r"([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
_RUNTIMES = (  # (runtime, pattern of the container's part of the path)
    ("containerd", re.compile(rf"cri-containerd-{_ID}\.scope")),
    ("cri-o", re.compile(rf"crio-(?:conmon-)?{_ID}\.scope")),
    ("docker", re.compile(rf"docker-{_ID}\.scope|/docker/{_ID}(?:/|$)")),
    ("cgroupfs", re.compile(rf"/pod{_UID}/{_ID}(?:/|$)")),
)
_POD = re.compile(rf"pod{_UID}(?:\.slice|/)")
# Suffixes Kubernetes controllers append to the pods they create: the random part is 5 characters of
# [bcdfghjklmnpqrstvwxz2456789]; a ReplicaSet's pod-template hash 5 to 10 of them.
_RAND = "[bcdfghjklmnpqrstvwxz2456789]"
_OWNER = (re.compile(rf"^(.+)-{_RAND}{{5,10}}-{_RAND}{{5}}$"),  # Deployment -> ReplicaSet -> pod
          re.compile(rf"^(.+)-{_RAND}{{5}}$"),                 # Job, DaemonSet, ReplicaSet
          re.compile(r"^(.+)-\d+$"))                            # StatefulSet


@dataclass(frozen=True)
class Identity:
    """Empty strings where a part is not known (a process outside any container has all of them empty)."""

    runtime: str = ""        # containerd, cri-o, docker, cgroupfs (a kubelet's cgroupfs driver)
    container_id: str = ""   # 64 hex digits
    pod_uid: str = ""
    pod: str = ""
    namespace: str = ""
    workload: str = ""       # the pod's name without its controller's suffixes (a guess: see above)


def from_cgroup(text: str) -> Identity:
    """The runtime, container and pod UID a /proc/PID/cgroup text names (v1 or v2)."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        for runtime, pat in _RUNTIMES:
            m = pat.search(path)
            if m:
                cid = next(g for g in m.groups() if g and len(g) == 64)
                pod = _POD.search(path)
                return Identity(runtime, cid, pod.group(1).replace("_", "-") if pod else "")
    return Identity()


def workload_of(pod: str) -> str:
    for pat in _OWNER:
        m = pat.match(pod)
        if m:
            return m.group(1)
    return pod


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 16).decode(errors="replace")
    except OSError:
        return ""


def identity_of(pid: int) -> Identity:
    """The identity of a running process; parts it cannot read are left empty."""
    ident = from_cgroup(_read(f"/proc/{pid}/cgroup"))
    if not ident.pod_uid:
        return ident
    env = _read(f"/proc/{pid}/environ").split("\0")
    pod = next((e[9:] for e in env if e.startswith("HOSTNAME=")), "")
    ns = _read(f"/proc/{pid}/root/var/run/secrets/kubernetes.io/serviceaccount/namespace").strip()
    return Identity(ident.runtime, ident.container_id, ident.pod_uid, pod, ns, workload_of(pod) if pod else "")
