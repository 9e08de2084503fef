"""The `mobius-collective` distribution as a user installs it: the abi3 wheel into a fresh
venv with `pip install`, then the README's three-line example in real processes; and the
sdist, which `pip install` builds from source.

The wheel is the one tests/collective/env.sh built from this tree (target/wheels). torch is
not reinstalled into the fresh venv (5 GB); a `.pth` file appends the cached torch venv's
site-packages after the fresh venv's own, so `mobius` and numpy come from the fresh install.
"""

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from harness import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def readme_example() -> list[str]:
    """The three lines of the README's Mobius example (so the test follows the README)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Mobius"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    lines = [ln for ln in block.splitlines() if ln.strip()]
    assert len(lines) == 3, lines
    return lines


def fresh_venv(path: Path) -> Path:
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(path)], check=True)
    return path / "bin" / "python"


def pip(py: Path, *args: str, env=None, timeout=1200) -> None:
    out = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                         capture_output=True, text=True, env=env, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(extra)
    return env


def test_wheel_installs_in_a_fresh_venv_and_the_readme_example_runs(tmp_path):
    wheels = sorted((ROOT / "target" / "wheels").glob("mobius_collective-*-abi3-*.whl"))
    assert wheels, "no abi3 wheel in target/wheels (tests/collective/env.sh builds it)"
    py = fresh_venv(tmp_path / "venv")
    pip(py, str(wheels[-1]), env=clean_env())
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "zz_borrowed_torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    script = tmp_path / "example.py"
    script.write_text("\n".join([
        "import json, os, sys",
        "import numpy as np",
        "RANK, WORLD = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])",
        "np_array = np.full(4, float(RANK + 1))",
        *readme_example(),
        "import torch, mobius",
        "t = torch.tensor([float(RANK + 1)])",
        "dist.all_reduce(t)",
        "print(json.dumps({'numpy': np_array.tolist(), 'torch': t.item(), 'mobius': mobius.__file__,",
        "                  'backend': dist.get_backend()}))",
        "dist.destroy_process_group()",
    ]) + "\n")
    world, port = 2, free_port()
    procs = [subprocess.Popen([str(py), str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=clean_env(RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                            MASTER_PORT=str(port), MOBIUS_TUNE="off"), start_new_session=True)
             for r in range(world)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}: {out[-2000:]}{err[-3000:]}"
        res = json.loads(out.strip().splitlines()[-1])
        assert res["numpy"] == [1.5] * 4  # avg of 1 and 2
        assert res["torch"] == 3.0
        assert res["backend"] == "mobius"
        assert res["mobius"].startswith(str(tmp_path / "venv")), res["mobius"]


@pytest.mark.full
@pytest.mark.timeout(1800)
def test_sdist_builds_from_source_with_pip(tmp_path):
    v = Path(sys.executable).parent
    out = subprocess.run([str(v / "maturin"), "sdist", "-m", str(ROOT / "crates/collective-py/Cargo.toml"),
                          "-o", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    sdist = next(tmp_path.glob("mobius_collective-*.tar.gz"))
    py = fresh_venv(tmp_path / "venv")
    # The build shares this tree's target directory, where env.sh's wheel build compiled the same
    # dependencies (release, same features): only the crates of the unpacked sdist compile.
    pip(py, str(sdist), env=clean_env(CARGO_TARGET_DIR=str(ROOT / "target")), timeout=1700)
    caps = subprocess.run([str(py), "-c", "import json, mobius; print(json.dumps(mobius.capabilities()))"],
                          capture_output=True, text=True, env=clean_env(), timeout=120)
    assert caps.returncode == 0, caps.stderr[-3000:]
    assert "bool" in json.loads(caps.stdout)["dtypes"]
