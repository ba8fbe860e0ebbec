"""The layering the README states: the scheduler and the KV cache are pure Python (no torch)."""

import subprocess
import sys
import textwrap

# Runs in a fresh interpreter where importing torch (or any torch.* module) fails, and where
# every attempt is recorded: an import that is caught and ignored still counts as a dependency.
NO_TORCH_CYCLE = textwrap.dedent(
    """
    import importlib.abc
    import sys

    attempts = []

    class BlockTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                attempts.append(name)
                raise ImportError(f"torch is blocked here ({name})")
            return None

    sys.meta_path.insert(0, BlockTorch())

    from platform_core.config import CacheConfig, SchedulerConfig
    from platform_core.kv_cache.manager import KVCacheManager
    from platform_core.sampling_params import SamplingParams
    from platform_core.scheduler.output import ModelRunnerOutput
    from platform_core.scheduler.request import Request, RequestStatus
    from platform_core.scheduler.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(4, 16, True), CacheConfig(block_size=4), 8)
    params = SamplingParams(temperature=0.0, max_tokens=3)
    request = Request(
        request_id="a", prompt_token_ids=list(range(10)), sampling_params=params, max_tokens=3
    )
    scheduler.add_request(request)
    finished = []
    for step in range(10):
        output = scheduler.schedule()
        sampled = {item.request_id: [100 + step] for item in output.scheduled if item.sample}
        finished += scheduler.update(output, ModelRunnerOutput(sampled=sampled))
        if not scheduler.num_unfinished:
            break
    assert [r.request_id for r in finished] == ["a"], finished
    assert request.status is RequestStatus.FINISHED_LENGTH, request.status
    assert len(request.output_token_ids) == 3, request.output_token_ids
    KVCacheManager(4, 4).check_integrity()
    assert not attempts, f"imported torch: {attempts}"
    assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
    print("ok")
    """
)


def test_scheduler_and_kv_cache_run_without_torch():
    result = subprocess.run(
        [sys.executable, "-c", NO_TORCH_CYCLE], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_kv_cache_does_not_import_the_scheduler():
    code = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        import platform_core.kv_cache as package

        for module in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            importlib.import_module(module.name)
        print(sorted(m for m in sys.modules if m.startswith("platform_core.scheduler")))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
