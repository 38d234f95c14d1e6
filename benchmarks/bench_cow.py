"""What a reinit writes, on a copy-on-write file system (XFS with reflink) and on the normal disk (ext4).

    sudo python benchmarks/bench_cow.py                        # XFS image + ext4, 3 alternating runs each
    sudo python benchmarks/bench_cow.py --baseline /path/to/old/surgeon   # also an older surgeon, alternately
    python benchmarks/bench_cow.py --no-xfs                    # the ext4 half only (no root needed)

As root it makes a sparse image file, formats it XFS with reflink (``mkfs.xfs -m reflink=1``, from the OS's
xfsprogs: ``apt-get install -y xfsprogs``) and mounts it on a loop device; where any of that is not permitted it
says so and runs the ext4 half alone. On each file system it builds a Llama-shaped sharded bf16 checkpoint (A:
hidden 2048, 16 layers, 32 heads of 64, 8 KV heads, 4 shards, 1.67 GB) and runs, alternately (A B A B ...):

  surgeon reinit SRC --layers -1 -o OUT        one layer's q/k/v (12 MB) change, in one of the 4 shards
  surgeon reinit SRC --layers all -o OUT       every layer's q/k/v (192 MB, 11.5%)
  surgeon reinit COPY --in-place --layers -1   COPY: a reflinked copy of SRC, made before the clock starts
  cp --reflink=always -r SRC OUT               (XFS only)
  cp --reflink=never -r SRC OUT

For each it prints the median wall time, and the new blocks the output allocated: the bytes of its files'
extents that the file system does not share with another file (``FIEMAP``, as ``filefrag -v`` shows them; for
the in-place run, how many more there are after it than before). Free space before and after would do too,
but XFS frees a removed file's blocks in the background, so the previous run's output blurs it. It then prints the math floor of
the two reinits (benchmarks/bench_math_floor.py: the per-head math at numpy's and BLAS's rates, and surgeon's
own time for it), the fixed start-up (Python, ``surgeon --help``, a dry run, torch's import), and each ``-o``
reinit's wall time against its floor: torch's import, the math's floor and writing the changed bytes. Everything it
made is removed at the end (the image unmounted and deleted), also when it fails. The machine may be shared:
read ratios and block counts, which do not depend on it, more than seconds.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, suppress
from pathlib import Path

from bench_reinit import VOCAB, layer_shapes, write_config

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHARDS = 4
SHAPE = (2048, 16, 32, 8, 64)  # hidden, layers, heads, KV heads, head dim: bench_reinit.py's A


def build_sharded(folder: Path, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> Path:
    """A Llama-shaped bf16 checkpoint in SHARDS shards with its index and config (bench_reinit's A, sharded)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    per_shard = -(-layers // SHARDS)
    shards: list[dict[str, tuple[int, ...]]] = [{} for _ in range(SHARDS)]
    shards[0]["model.embed_tokens.weight"] = (VOCAB, hidden)
    for i in range(layers):
        shards[i // per_shard] |= layer_shapes(f"model.layers.{i}", hidden, heads, kv_heads, head_dim)
    shards[-1] |= {"model.norm.weight": (hidden,), "lm_head.weight": (VOCAB, hidden)}
    weight_map = {}
    for n, shapes in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{SHARDS:05d}.safetensors"
        sd = {k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
        save_file(sd, folder / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(sd, name)
        del sd
    total = sum((folder / f).stat().st_size for f in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    write_config(folder, hidden, layers, heads, kv_heads, head_dim)
    return folder


_FIEMAP = 0xC020660B  # FS_IOC_FIEMAP (linux/fs.h)
_EXTENT = struct.Struct("=QQQQQI12x")  # struct fiemap_extent: logical, physical, length, 2 reserved, flags
_SHARED, _LAST, _SYNC = 0x2000, 0x1, 0x1  # FIEMAP_EXTENT_SHARED, FIEMAP_EXTENT_LAST, FIEMAP_FLAG_SYNC


def unshared_bytes(path: Path) -> int:
    """The bytes of ``path``'s extents that no other file shares (its own blocks), every file under a folder."""
    if path.is_dir():
        return sum(unshared_bytes(p) for p in path.rglob("*") if p.is_file())
    total, start, count = 0, 0, 256
    with open(path, "rb") as f:
        while True:
            buf = bytearray(
                struct.pack("=QQIIII", start, (1 << 64) - 1, _SYNC, 0, count, 0) + bytes(_EXTENT.size * count)
            )
            fcntl.ioctl(f.fileno(), _FIEMAP, buf)
            (mapped,) = struct.unpack_from("=I", buf, 20)
            last = mapped == 0
            for i in range(mapped):
                logical, _, length, _, _, flags = _EXTENT.unpack_from(buf, 32 + i * _EXTENT.size)
                total += 0 if flags & _SHARED else length
                start, last = logical + length, bool(flags & _LAST)
            if last:
                return total


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def surgeon(pythonpath: Path, *args: object) -> list[str]:
    # -P: not the working directory first on sys.path, so PYTHONPATH picks the surgeon that runs
    return ["env", f"PYTHONPATH={pythonpath}", sys.executable, "-P", "-m", "surgeon", *map(str, args)]


def case_list(src: Path, out: Path, copy: Path, *, xfs: bool, versions: dict[str, Path]) -> list[dict]:
    """(label, command, what to make before it untimed, what to remove after)."""
    cases = []
    for tag, path in versions.items():
        cases += [
            {"label": f"{tag}reinit --layers -1 -o", "argv": surgeon(path, "reinit", src, "--layers", "-1", "-o", out),
             "out": out},
            {"label": f"{tag}reinit --layers all -o", "argv": surgeon(path, "reinit", src, "-o", out), "out": out},
            {"label": f"{tag}reinit --in-place --layers -1", "argv": surgeon(path, "reinit", copy, "--in-place",
             "--layers", "-1"), "out": copy, "before": ["cp", "-r", "--reflink=auto", str(src), str(copy)]},
        ]  # fmt: skip
    if xfs:
        cases.append(
            {"label": "cp --reflink=always -r", "argv": ["cp", "-r", "--reflink=always", src, out], "out": out}
        )
    cases.append({"label": "cp --reflink=never -r", "argv": ["cp", "-r", "--reflink=never", src, out], "out": out})
    return cases


def run_cases(fs: Path, src: Path, repeats: int, *, xfs: bool, versions: dict[str, Path]) -> list[dict]:
    out, copy = fs / "out", fs / "copy"
    cases = case_list(src, out, copy, xfs=xfs, versions=versions)
    for case in cases:
        case["seconds"], case["cpu"], case["allocated"] = [], [], []
    for _ in range(repeats):  # every case once per round: drift on a shared machine hits all alike
        for case in cases:
            remove(out)
            remove(copy)
            if "before" in case:
                subprocess.run(case["before"], check=True)
            target = case["out"]
            before = unshared_bytes(target) if target.exists() else 0
            os.sync()
            cpu, start = _children_cpu(), time.perf_counter()
            subprocess.run([str(a) for a in case["argv"]], check=True, stdout=subprocess.DEVNULL)
            case["seconds"].append(time.perf_counter() - start)
            case["cpu"].append(_children_cpu() - cpu)
            case["allocated"].append(unshared_bytes(target) - before)
    remove(out)
    remove(copy)
    return [
        {
            "case": c["label"],
            "seconds": statistics.median(c["seconds"]),
            "spread": (max(c["seconds"]) - min(c["seconds"])) / statistics.median(c["seconds"]),
            "cpu": statistics.median(c["cpu"]),
            "allocated": statistics.median(c["allocated"]),
        }
        for c in cases
    ]


def _children_cpu() -> float:
    """CPU seconds (user + system) of every child waited for so far: a measure a busy machine blurs less."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def show(title: str, rows: list[dict], size: int) -> None:
    print(f"\n{title}")
    header = f"{'case':<40} {'wall':>8} {'spread':>7} {'CPU':>7} {'new blocks':>12} {'of the model':>13}"
    print(header + "\n" + "-" * len(header))
    for r in rows:
        print(
            f"{r['case']:<40} {r['seconds']:7.2f}s {r['spread']:6.0%} {r['cpu']:6.2f}s {r['allocated'] / 1e6:9.1f} MB "
            f"{r['allocated'] / size:12.2%}"
        )


def changed_bytes(src: Path, last_only: bool) -> int:
    """The bytes of the q/k/v tensors a reinit of the last layer (or every layer) changes."""
    from safetensors import safe_open

    layers = SHAPE[1]
    total = 0
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                if any(f"layers.{i}.self_attn.{p}_proj" in name for p in "qkv" for i in range(layers)) and (
                    not last_only or f"layers.{layers - 1}." in name
                ):
                    total += f.get_slice(name).get_shape()[0] * f.get_slice(name).get_shape()[1] * 2
    return total


@contextmanager
def xfs_image(where: Path, size: int):
    """An XFS file system with reflink on a loop device, mounted; None where this machine cannot make one."""
    why = None
    if os.geteuid() != 0:
        why = "not root (mounting a loop device needs root)"
    elif shutil.which("mkfs.xfs") is None:
        why = "mkfs.xfs not found (apt-get install -y xfsprogs)"
    if why:
        print(f"skipping XFS: {why}")
        yield None
        return
    image, mount = where / "xfs.img", where / "xfs"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(size)  # sparse: the disk holds only what is written
    mounted = False
    try:
        subprocess.run(["mkfs.xfs", "-q", "-f", "-m", "reflink=1", str(image)], check=True, capture_output=True)
        done = subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"skipping XFS: mounting is not permitted here ({done.stderr.strip()})")
            yield None
            return
        mounted = True
        yield mount
    finally:
        if mounted:
            subprocess.run(["umount", str(mount)], check=True)
        image.unlink(missing_ok=True)


def math_floor(select: str, repeats: int, pythonpath: Path) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run(
            ["env", f"PYTHONPATH={pythonpath}", sys.executable, str(HERE / "bench_math_floor.py"), "--shape", "A",
             "--select", select, "--repeats", str(repeats), "--json", f.name],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        return json.loads(Path(f.name).read_text())


def write_floor(fs: Path, sizes: dict[str, int], repeats: int) -> dict[str, float]:
    """Median seconds to write each of ``sizes`` bytes to a new file on ``fs`` (buffered, no fsync: as a reinit's
    ``-o`` writes its changed bytes), alternately."""
    block = os.urandom(8 << 20)
    times: dict[str, list[float]] = {k: [] for k in sizes}
    for _ in range(repeats):
        for key, size in sizes.items():
            path = fs / "write-floor"
            start = time.perf_counter()
            with open(path, "wb") as f:
                for offset in range(0, size, len(block)):
                    f.write(block[: min(len(block), size - offset)])
            times[key].append(time.perf_counter() - start)
            path.unlink()
    return {k: statistics.median(v) for k, v in times.items()}


def against_floor(rows: list[dict], startup: dict[str, float], floors: dict, writes: dict[str, float]) -> list[dict]:
    """Each ``-o`` reinit's wall time against its floor: the start-up any torch program pays (Python and
    ``import torch``), the per-head math at its floor, and writing the changed bytes."""
    out = []
    for sel in ("-1", "all"):
        row = next((r for r in rows if r["case"] == f"reinit --layers {sel} -o"), None)
        if row is None:
            continue
        parts = (startup["python -c 'import torch'"], floors[sel]["floor_wall_s"], writes[sel])
        out.append({"case": row["case"], "wall": row["seconds"], "floor": sum(parts), "parts": parts})
    return out


def show_floor(title: str, rows: list[dict]) -> None:
    print(
        f"\n{title}: wall against the floor (Python and torch's import + the math's floor + writing the changed bytes)"
    )
    for r in rows:
        start, math, write = r["parts"]
        print(
            f"  {r['case']:<28} wall {r['wall']:6.2f} s, floor {r['floor']:6.2f} s "
            f"({start:.2f} + {math:.3f} + {write:.3f}): {r['wall'] / r['floor']:.2f}x"
        )


def startup(repeats: int, src: Path, pythonpath: Path) -> dict[str, float]:
    """The fixed costs, alternately: Python itself, surgeon --help, a dry run (open, detect, plan), torch's import."""
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "surgeon --help": surgeon(pythonpath, "--help"),
        "surgeon reinit --dry-run": surgeon(pythonpath, "reinit", src, "--dry-run"),
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    }
    times: dict[str, list[float]] = {k: [] for k in commands}
    for _ in range(repeats):
        for key, argv in commands.items():
            start = time.perf_counter()
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
            times[key].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-xfs", action="store_true", help="the ext4 half only")
    ap.add_argument("--baseline", type=Path, help="another surgeon's source root, run alternately beside this one")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    versions = {"": ROOT} | ({"baseline ": args.baseline.resolve()} if args.baseline else {})
    results: dict = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        tmp = Path(tmp)
        ext4 = tmp / "ext4"
        src = build_sharded(ext4 / "src", *SHAPE)
        size = sum(p.stat().st_size for p in src.iterdir())
        last, every = changed_bytes(src, True), changed_bytes(src, False)
        print(
            f"A, sharded: {size / 1e9:.2f} GB in {SHARDS} shards; --layers -1 changes {last / 1e6:.1f} MB "
            f"({last / size:.2%}), --layers all {every / 1e6:.0f} MB ({every / size:.1%}); "
            f"{args.repeats} alternating runs, medians"
        )
        if not args.no_xfs:
            with xfs_image(tmp, 4 * size) as xfs:
                if xfs is not None:
                    xsrc = build_sharded(xfs / "src", *SHAPE)
                    rows = run_cases(xfs, xsrc, args.repeats, xfs=True, versions=versions)
                    show("XFS (reflink), on a loop device", rows, size)
                    results["xfs"] = rows
                    results["xfs_write"] = write_floor(xfs, {"-1": last, "all": every}, args.repeats)
                    remove(xsrc)
        rows = run_cases(ext4, src, args.repeats, xfs=False, versions=versions)
        show(f"ext4 ({ext4})", rows, size)
        results["ext4"] = rows
        results["ext4_write"] = write_floor(ext4, {"-1": last, "all": every}, args.repeats)
        results["startup"] = startup(args.repeats + 2, src, ROOT)
    floors = {sel: math_floor(sel, args.repeats, ROOT) for sel in ("-1", "all")}
    results["floor"] = floors
    print("\nthe per-head math of A (benchmarks/bench_math_floor.py), medians:")
    for sel, f in floors.items():
        print(
            f"  --layers {sel:<4} floor {f['floor_wall_s']:6.3f} s, surgeon {f['surgeon_wall_s']:6.3f} s "
            f"({f['ratio_wall']:.2f}x wall, {f['ratio_cpu']:.2f}x CPU)"
        )
    print("\nstart-up, medians:")
    for k, v in results["startup"].items():
        print(f"  {k:<28} {v:6.3f} s")
    for fs in ("xfs", "ext4"):
        if fs in results:
            results[f"{fs}_floor"] = against_floor(results[fs], results["startup"], floors, results[f"{fs}_write"])
            show_floor("XFS" if fs == "xfs" else "ext4", results[f"{fs}_floor"])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    with suppress(Exception):
        os.sync()


if __name__ == "__main__":
    main()
