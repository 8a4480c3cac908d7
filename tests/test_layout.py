"""The repository's layout: import names match folders, no path tricks, no symlinks."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent


def _tracked() -> list[pathlib.Path]:
  out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
  return [ROOT / p for p in out]


def test_kernels_folder_is_no_package_and_holds_clis_kernels():
  assert not (ROOT / "kernels" / "__init__.py").exists()
  assert (ROOT / "kernels" / "clis_kernels" / "__init__.py").exists()
  probe = ("import kernels; print(getattr(kernels, '__file__', None), hasattr(kernels, 'attention'), "
           "list(getattr(kernels, '__path__', [])))")
  result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
  # Either no `kernels` at all, or (from the repository root) an empty namespace package with none of our code, or
  # another distribution's `kernels` (transformers >= 5.25 installs Hugging Face's), which is none of our folder.
  if result.returncode != 0:
    return
  file, has_attention, *_ = result.stdout.split(maxsplit=2)
  assert has_attention == "False", result.stdout
  assert file == "None" or not pathlib.Path(file).resolve().is_relative_to(ROOT / "kernels"), result.stdout


def test_imports_come_from_the_folders_named_like_them():
  probe = "import clis_kernels, clis_train; print(clis_kernels.__file__); print(clis_train.__file__)"
  out = subprocess.run([sys.executable, "-c", probe], cwd="/", capture_output=True, text=True, check=True).stdout
  kernels_file, train_file = map(pathlib.Path, out.split())
  assert kernels_file.parent == (ROOT / "kernels" / "clis_kernels").resolve()
  assert train_file.parent == (ROOT / "clis_train").resolve()


def test_no_path_tricks_or_symlinks():
  code = [p for p in _tracked() if p.suffix in (".py", ".sh", ".md") and p.is_file()
          and "benchmarks/results" not in str(p)]  # raw records of past runs stay as they were
  tricks = [str(p.relative_to(ROOT)) for p in code
            if p.name != "test_layout.py" and re.search(r"sys\.path\.(insert|append)|ln -s", p.read_text())]
  assert tricks == []
  assert [str(p) for p in _tracked() if p.is_symlink()] == []
