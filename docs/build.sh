#!/usr/bin/env bash
# Build the HTML reference into docs/_build/html from the docstrings and the guide. Any Sphinx
# warning (a malformed docstring, a reference that does not resolve) fails the build.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
rm -rf docs/_build docs/api
"$PYTHON" -m sphinx -W --keep-going -q -b html -d docs/_build/doctrees docs docs/_build/html
echo "docs written to docs/_build/html/index.html"
