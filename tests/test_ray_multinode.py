"""Tensor parallelism across two Ray nodes in two network namespaces joined by a veth pair: the
head node (no CPUs to give) and the driver in one, a worker node in the other, so rank 1 can only
be placed on the other "host" and the group's collectives cross the link."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
from netns import host_pair, in_namespace

pytest.importorskip("ray", reason="ray is not installed (pip install 'platform-core[ray]')")

GCS_PORT = 6390  # outside the range Ray gives its workers (10002-19999)

# Run inside the head's namespace: one rank alone, then two ranks through the cluster.
DRIVER = """
import json, os, sys
import torch
from platform_core import LLM, SamplingParams
model, address = sys.argv[1], sys.argv[2]
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
prompts = [{"prompt_token_ids": [1, 5, 9, 13]}, {"prompt_token_ids": [2, 4, 6, 8, 10, 12]}]
def tokens(llm):
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
alone = LLM(model, dtype="float32")
expected = tokens(alone)
alone.shutdown()
tp = LLM(model, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray",
         ray_address=address)
try:
    got = tokens(tp)
    nodes = tp.engine.executor.worker_nodes
    threads = torch.get_num_threads()  # rank 0's, alone on its node
finally:
    tp.shutdown()
result = {"expected": expected, "got": got, "worker_nodes": nodes, "threads": threads}
print(json.dumps({**result, "cores": os.cpu_count()}))
"""


@pytest.fixture(scope="module")
def hosts():
    with host_pair("pr", 232) as pair:
        yield pair


def _start_node(namespace: str, env: dict[str, str], log, *flags: str) -> subprocess.Popen:
    """``ray start --block`` in ``namespace``, returned once the node is up; its own process
    group holds every Ray process it starts, so killing the group leaves nothing."""
    command = in_namespace(namespace, "ray", "start", "--block", "--disable-usage-stats", *flags)
    node = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    for line in node.stdout:
        log.write(line)
        if "--block" in line:  # printed once the node's processes run
            return node
    raise AssertionError(f"ray start {' '.join(flags)} exited with {node.wait()}")


def _stop(node: subprocess.Popen) -> None:
    """SIGTERM to ``ray start --block`` (it stops the node's processes), then SIGKILL to
    whatever of its process group is left."""
    node.terminate()
    try:
        node.wait(30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGKILL)
        node.wait()


def test_tp2_spans_two_ray_nodes_and_matches_one_rank(hosts, tiny_model_dir, tmp_path):
    # Ray's own directory (sessions, the address of "the current cluster" that a later local
    # ray.init would find) stays this test's; Ray's socket paths must stay short.
    ray_dir = tempfile.mkdtemp(prefix="pc-ray-", dir="/tmp")
    token = tmp_path / "ray-token"
    token.write_text(secrets.token_hex(32))
    # Token authentication: Ray refused a node joining over the network without a shared token.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    address = f"{hosts.first_ip}:{GCS_PORT}"
    nodes = []
    with (tmp_path / "ray.log").open("w") as log:
        try:
            head_flags = [
                "--head",
                f"--port={GCS_PORT}",
                "--num-cpus=0",
                "--include-dashboard=false",
                f"--temp-dir={ray_dir}",
            ]
            nodes.append(
                _start_node(
                    hosts.first, env, log, *head_flags, f"--node-ip-address={hosts.first_ip}"
                )
            )
            worker_flags = [f"--address={address}", "--num-cpus=1", f"--temp-dir={ray_dir}"]
            nodes.append(
                _start_node(
                    hosts.second, env, log, *worker_flags, f"--node-ip-address={hosts.second_ip}"
                )
            )
            model = str(tiny_model_dir("llama"))
            run = in_namespace(hosts.first, sys.executable, "-c", DRIVER, model, address)
            done = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300)
        finally:
            for node in reversed(nodes):
                _stop(node)
            shutil.rmtree(ray_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["worker_nodes"] == [hosts.second_ip]  # rank 1 ran on the other host
    assert result["got"] == result["expected"]
    assert result["threads"] == result["cores"]  # no rank shares rank 0's node
