"""The GPU scripts run from a clone alone: nothing the repository holds points outside it, and the
wheels carried to a GPU machine without network (benchmarks/gpu_fetch_wheels.sh writes them)
are installed by benchmarks/gpu_wheels.sh before the project on PYTHONPATH.
"""

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUTSIDE = "../" + "shared"  # the folder beside the checkout the GPU scripts once needed
HELD = ("README.md", "pyproject.toml", "docs", "benchmarks", "scripts", ".ci", "examples",
        "featherweight", "tests")  # fmt: skip


def test_no_file_points_outside_the_repository():
    files = [REPO / name for name in HELD if (REPO / name).is_file()]
    files += [path for name in HELD if (REPO / name).is_dir() for path in (REPO / name).rglob("*")]
    pointing = [
        str(path.relative_to(REPO))
        for path in files
        if path.is_file()
        and "__pycache__" not in path.parts
        and OUTSIDE in path.read_text("latin-1")
    ]
    assert pointing == []


def _wheel(folder: Path, name: str) -> Path:
    """A one-module wheel of `name`: what pip needs to install it offline."""
    info = f"{name}-0.1.dist-info"
    path = folder / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name}.py", "CARRIED = True\n")
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return path


def _carried_imports(wheels: Path) -> subprocess.CompletedProcess:
    script = (
        f"python={sys.executable}; GPU_CHECK_WHEELS={wheels}; source benchmarks/gpu_wheels.sh; "
        'gpu_wheels test; "$python" -c "import carried_wheel, carried_extra, featherweight; '
        'print(featherweight.__file__)"'
    )
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True)


def test_carried_wheels_and_unpacked_packages_come_before_the_project(tmp_path):
    wheels = tmp_path / ".whl"
    wheels.mkdir()
    _wheel(wheels, "carried_wheel")
    extra = tmp_path / ".whl-extra" / "site"
    extra.mkdir(parents=True)
    (extra / "carried_extra.py").write_text("CARRIED = True\n")  # as bitsandbytes is carried
    result = _carried_imports(wheels)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "[test] installed 1 wheels" in result.stdout
    assert str(REPO / "featherweight") in result.stdout  # the project itself, not an installed copy


def test_without_carried_wheels_the_installed_packages_are_used(tmp_path):
    result = _carried_imports(tmp_path / "none")
    assert result.returncode != 0  # nothing carried: the test's modules do not exist
    assert "no wheels in" in result.stdout
