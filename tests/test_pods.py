"""Container and pod identity from cgroup paths of the shapes containerd, CRI-O, Docker and the
kubelet's cgroupfs driver write, and a pod's workload from its name."""

from __future__ import annotations

import os

import pytest

from gputrace.hostview.pods import Identity, from_cgroup, identity_of, workload_of

CID = "3f4e2a1b" * 8
UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


@pytest.mark.parametrize("text, runtime, uid", [
    # containerd with the systemd cgroup driver (cgroup v2)
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
     f"cri-containerd-{CID}.scope", "containerd", UID),
    # CRI-O, systemd driver, a guaranteed pod (no QoS slice)
    (f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope", "cri-o", UID),
    # the kubelet's cgroupfs driver (containerd or CRI-O), cgroup v1: one line per hierarchy
    (f"12:pids:/kubepods/besteffort/pod{UID}/{CID}\n11:memory:/kubepods/besteffort/pod{UID}/{CID}\n"
     f"0::/", "cgroupfs", UID),
    # Docker, systemd driver (v2) and cgroupfs driver (v1): no pod
    (f"0::/system.slice/docker-{CID}.scope", "docker", ""),
    (f"9:cpu,cpuacct:/docker/{CID}\n1:name=systemd:/docker/{CID}", "docker", ""),
])
def test_runtime_container_and_pod_from_the_cgroup_path(text, runtime, uid):
    assert from_cgroup(text) == Identity(runtime, CID, uid)


@pytest.mark.parametrize("text", ["0::/user.slice/user-1000.slice/session-3.scope", "0::/", "",
                                  "0::/system.slice/ssh.service", "0::/kubepods.slice/kubepods-burstable.slice"])
def test_a_process_outside_any_container_has_no_identity(text):
    assert from_cgroup(text) == Identity()


@pytest.mark.parametrize("pod, workload", [
    ("trainer-7d9f8b6c5d-x2k4q", "trainer"),        # Deployment -> ReplicaSet -> pod
    ("llm-serve-68b5c4d9f7-9wz2n", "llm-serve"),
    ("nightly-eval-28790520-bq7xz", "nightly-eval-28790520"),  # a CronJob's Job's pod: the Job, by its name
    ("dcgm-exporter-5wz7k", "dcgm-exporter"),       # DaemonSet
    ("db-2", "db"),                                 # StatefulSet
    ("standalone", "standalone"),                   # a bare pod
])
def test_workload_from_the_pod_name(pod, workload):
    assert workload_of(pod) == workload


def test_this_process_reads_without_error():
    ident = identity_of(os.getpid())
    assert isinstance(ident, Identity) and (ident.pod == "" or ident.pod_uid)
    assert identity_of(2**22 + 11) == Identity()  # no such process: nothing known, no error
