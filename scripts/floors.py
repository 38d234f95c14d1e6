"""Print pyproject.toml's runtime dependency floors as pins (`name==floor`), one a line: the floors job's spec."""

import re
from pathlib import Path

import tomllib

deps = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["dependencies"]
for dep in deps:
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)(,.*)?", dep.replace(" ", ""))
    assert m, f"{dep}: every runtime dependency needs a >= floor"
    print(f"{m[1]}=={m[2]}")
