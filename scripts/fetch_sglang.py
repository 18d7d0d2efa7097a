"""Fetch SGLang 0.5.23's released source for tests/test_sglang_real.py (`make sglang-src`).

    python scripts/fetch_sglang.py .cache/sglang-0.5.23

Downloads the sglang 0.5.23 wheel with pip (`--no-deps`; it is only read, never installed or
imported as a package), checks its sha256, and unpacks it into DEST/src; msgspec, the one
dependency of SGLang's `SamplingParams`, goes into DEST/deps (`pip install --target`, for this
Python). Everything is built in a temporary sibling folder that is renamed to DEST only once
complete, so DEST exists only whole: when it does, nothing is downloaded again. A failed run
removes its temporary folder; one killed outright leaves a `DEST.partial-*` folder behind, which
no later run reads (delete it at will).
"""

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SGLANG = "0.5.23"
# The release has no pure-Python wheel, and the tests read only its Python source: the platform
# flags fetch this one wheel on any machine, and its hash pins the bytes the tests read.
WHEEL = f"sglang-{SGLANG}-cp311-cp311-manylinux_2_34_x86_64.whl"
WHEEL_SHA256 = "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"
MSGSPEC = "0.22.0"


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def fetch(dest: Path) -> None:
    if dest.is_dir():
        print(f"{dest}: already there")
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".partial-", dir=dest.parent))
    try:
        pip("download", "-q", "--no-deps", "--only-binary=:all:", "--platform",
            "manylinux_2_34_x86_64", "--python-version", "3.11", "--implementation", "cp",
            "--abi", "cp311", f"sglang=={SGLANG}", "-d", str(tmp / "wheel"))
        wheel = tmp / "wheel" / WHEEL
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != WHEEL_SHA256:
            raise SystemExit(f"{WHEEL}: sha256 {digest}, expected {WHEEL_SHA256}")
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp / "src")
        shutil.rmtree(tmp / "wheel")  # the tests read only the unpacked source
        pip("install", "-q", "--no-deps", "--no-compile", "--only-binary=:all:",
            "--target", str(tmp / "deps"), f"msgspec=={MSGSPEC}")
        tmp.chmod(0o755)  # mkdtemp makes it private
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if dest.is_dir():  # a concurrent run finished first: its folder is as good
            return
        raise
    print(f"{dest}: SGLang {SGLANG} unpacked")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    fetch(Path(sys.argv[1]))
