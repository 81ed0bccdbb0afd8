"""ensure_demo's bookkeeping, with a fake build in place of the real one (fast): a finished
build is renamed into place whole, concurrent callers build once, a failed or killed build leaves
no demo behind, and a change of recipe rebuilds."""

from __future__ import annotations

import threading
import time

import pytest

import loraplex.demo.build
import loraplex.demo.recipe
from loraplex.demo import DEMO_ADAPTERS, DemoAssets, ensure_demo
from loraplex.demo.assets import BUILDING_PREFIX, STAMP_NAME


class FakeBuild:
    """Writes the files ensure_demo checks for; counts its calls; can be slow or fail."""

    def __init__(self, seconds: float = 0.0, error: Exception | None = None) -> None:
        self.seconds, self.error, self.calls = seconds, error, 0
        self.lock = threading.Lock()

    def __call__(self, assets: DemoAssets) -> None:
        with self.lock:
            self.calls += 1
        assets.model_dir.mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            (assets.model_dir / name).write_text(name)
        time.sleep(self.seconds)
        if self.error is not None:
            raise self.error
        for folder in assets.adapters.values():
            folder.mkdir(parents=True)
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                (folder / name).write_text(name)


@pytest.fixture
def fake_build(monkeypatch):
    def install(**kwargs) -> FakeBuild:
        build = FakeBuild(**kwargs)
        monkeypatch.setattr(loraplex.demo.build, "build_demo", build)
        return build

    return install


def test_builds_once_and_reuses(tmp_path, fake_build):
    build = fake_build()
    assets = ensure_demo(tmp_path)
    assert assets.model_dir == tmp_path / "demo" / "model"
    assert list(assets.adapters) == [adapter.name for adapter in DEMO_ADAPTERS]
    assert (tmp_path / "demo" / STAMP_NAME).is_file()
    assert ensure_demo(tmp_path) == assets
    assert build.calls == 1


def test_concurrent_callers_build_once(tmp_path, fake_build):
    build = fake_build(seconds=0.3)
    results: list[DemoAssets] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_demo(tmp_path)))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert build.calls == 1
    assert len(results) == 3 and all(result == results[0] for result in results)


def test_failed_build_leaves_nothing(tmp_path, fake_build):
    fake_build(error=RuntimeError("out of disk"))
    with pytest.raises(RuntimeError, match="out of disk"):
        ensure_demo(tmp_path)
    assert not (tmp_path / "demo").exists()
    assert not list(tmp_path.glob(BUILDING_PREFIX + "*"))
    build = fake_build()
    ensure_demo(tmp_path)
    assert build.calls == 1


def test_killed_build_leftovers_are_removed(tmp_path, fake_build):
    leftover = tmp_path / f"{BUILDING_PREFIX}killed"
    (leftover / "model").mkdir(parents=True)
    fake_build()
    ensure_demo(tmp_path)
    assert not leftover.exists()


def test_incomplete_demo_is_rebuilt(tmp_path, fake_build):
    build = fake_build()
    assets = ensure_demo(tmp_path)
    (assets.adapters[DEMO_ADAPTERS[0].name] / "adapter_model.safetensors").unlink()
    ensure_demo(tmp_path)
    assert build.calls == 2


def test_new_recipe_rebuilds(tmp_path, fake_build, monkeypatch):
    build = fake_build()
    ensure_demo(tmp_path)
    (tmp_path / "demo" / "old-file").write_text("from the old recipe")
    monkeypatch.setattr(loraplex.demo.recipe, "recipe_digest", lambda: "another recipe")
    ensure_demo(tmp_path)
    assert build.calls == 2
    assert not (tmp_path / "demo" / "old-file").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["demo", "demo.lock"]
