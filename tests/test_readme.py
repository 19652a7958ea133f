"""The README's first example must run as written."""
import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_first_python_example_runs():
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    program = block + "\nassert w.shape == (3,) and bool(torch.isfinite(w).all())\nprint('ok')\n"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")
