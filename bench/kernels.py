"""Microbenchmark of the Triton kernels against exact SDPA decode attention, with a copy roofline.

    python -m bench.kernels                 # on a CUDA GPU: the table for 4k..128k tokens
    python -m bench.kernels --dry-run       # on the CPU: tiny shapes under Triton's interpreter,
                                            # to check the script (timings meaningless)

Shapes: Llama-3-8B decode (32 query / 8 KV heads, head_dim 128), one query token, random data,
bfloat16 dense caches. Every row reports microseconds (median, L2 flushed between runs by
``triton.testing.do_bench``), the bytes the operation must move (cache read + outputs written),
the achieved GB/s, the time of a device-to-device copy of the same bytes and its bandwidth
(read + write: the roofline), the fraction of it achieved, and the speed-up over exact SDPA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

HQ, HKV, D = 32, 8, 128
LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)


@dataclass
class Row:
    n: int
    op: str
    bits_per_coord: float  # bytes of the cache per K+V coordinate, in bits
    us: float
    bytes_moved: int
    gbps: float
    copy_us: float  # device-to-device copy of bytes_moved bytes
    copy_gbps: float  # the copy's bandwidth, counting its read and its write
    roofline_frac: float  # gbps / copy_gbps
    speedup_vs_sdpa: float
    max_err: float | None  # against the torch reference on this device (first length only)


def _parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="*", default=None, help="cache lengths (default 4k..128k)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    return p.parse_args()


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _seg_bytes(seg) -> int:
    parts = [seg.keys, seg.values, seg.index, seg.log_weights]
    if seg.qjl is not None:
        qk = seg.qjl
        parts += [qk.bits, qk.norms, qk.out_bits, qk.out_norms, qk.out_idx]
    if seg.qvalues is not None:
        parts += [seg.qvalues.codes, seg.qvalues.scale, seg.qvalues.minimum]
    return _nbytes(*parts)


def _timer(device):
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3

    def cpu(fn):
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6

    return cpu


def _cases(n: int, device, dtype):
    """(name, segments, bytes of the cache) for one length; the segments hold random data."""
    import torch

    from kernels import make_sketch, outlier_channels, qjl_quantize
    from kernels.formats import Segment
    from kernels.quant import quantize_groups

    k = torch.randn(HKV, n, D, device=device, dtype=dtype)
    v = torch.randn(HKV, n, D, device=device, dtype=dtype)
    s = make_sketch(1, 256, D, torch.Generator().manual_seed(0))[0].to(device)
    s_out = make_sketch(1, 128, D, torch.Generator().manual_seed(1))[0].to(device)
    plain = qjl_quantize(k, s)
    with_out = qjl_quantize(k, s, s_out, outlier_channels(k, 32, 8), 32)
    keep = n // 4
    idx = torch.stack([torch.randperm(n, device=device)[:keep] for _ in range(HKV)]).to(torch.int32)
    logw = torch.zeros(HKV, n, device=device)
    out = [
        ("dense kernel", [Segment(keys=k, values=v)]),
        ("kept 25% by index + log-weights", [Segment(keys=k, values=v, index=idx, log_weights=logw)]),
        ("QJL m=256, values 4-bit", [Segment(qjl=plain, qvalues=quantize_groups(v, 4, 32, -1))]),
        ("QJL m=256+128 outliers, values 2-bit", [Segment(qjl=with_out, qvalues=quantize_groups(v, 2, 32, -1))]),
        ("QJL m=256+128 outliers, values 4-bit", [Segment(qjl=with_out, qvalues=quantize_groups(v, 4, 32, -1))]),
    ]
    return k, v, out


def _seg_read_bytes(seg) -> int:
    """Bytes a segment's attention reads: with an index only the kept rows (plus the index)."""
    if seg.index is None:
        return _seg_bytes(seg)
    n_rows, kept = seg.n_rows, seg.n
    row_bytes = _seg_bytes(seg) - _nbytes(seg.index)
    return row_bytes * kept // n_rows + _nbytes(seg.index)


def _copy_us(nbytes: int, device, timer) -> float:
    import torch

    src = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src))


def bench_length(n: int, device, dtype, timer, check: bool) -> list[Row]:
    import torch
    import torch.nn.functional as F

    from kernels import qjl_scores
    from kernels.decode_attention import decode_attention, decode_attention_torch

    k, v, cases = _cases(n, device, dtype)
    q = torch.randn(HQ, 1, D, device=device, dtype=dtype)
    scaling = D**-0.5
    out_bytes = HQ * D * q.element_size()

    def sdpa():
        return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scaling, enable_gqa=True)

    sdpa_bytes = _nbytes(k, v) + out_bytes
    sdpa_us = timer(sdpa)
    rows = [_row(n, "exact SDPA", 16.0, sdpa_us, sdpa_bytes, device, timer, sdpa_us, None)]
    for name, segs in cases:
        moved = sum(_seg_read_bytes(s) for s in segs) + out_bytes
        bits = 8 * sum(_seg_bytes(s) for s in segs) / (2 * HKV * n * D)
        err = None
        if check:
            ref = decode_attention_torch(q.float(), segs, scaling)
            err = (decode_attention(q, segs, scaling).float() - ref).abs().max().item()
        us = timer(lambda segs=segs: decode_attention(q, segs, scaling))
        rows.append(_row(n, name, bits, us, moved, device, timer, sdpa_us, err))
    qk = cases[3][1][0].qjl
    score_bytes = _nbytes(qk.bits, qk.norms, qk.out_bits, qk.out_norms) + HQ * n * 4
    err = None
    if check:
        from kernels.qjl import qjl_scores_torch

        err = (qjl_scores(q, qk) - qjl_scores_torch(q, qk)).abs().max().item()
    us = timer(lambda: qjl_scores(q, qk))
    rows.append(
        _row(
            n,
            "QJL scores only (m=256+128, fp32 out)",
            8 * score_bytes / (HKV * n * D),
            us,
            score_bytes,
            device,
            timer,
            sdpa_us,
            err,
        )
    )
    return rows


def _row(n, op, bits, us, moved, device, timer, sdpa_us, err) -> Row:
    copy = _copy_us(moved, device, timer)
    gbps, copy_gbps = moved / us / 1e3, 2 * moved / copy / 1e3
    return Row(
        n, op, round(bits, 2), round(us, 1), moved, round(gbps, 1), round(copy, 1), round(copy_gbps, 1),
        round(gbps / copy_gbps, 3), round(sdpa_us / us, 2), err,
    )  # fmt: skip


def markdown(rows: list[Row], device_name: str, dtype: str) -> str:
    head = f"Device: {device_name}. Hq={HQ}, Hkv={HKV}, d={D}, one query token, dense caches in {dtype}.\n\n"
    head += (
        "| tokens | operation | bits/coord | µs | MB moved | GB/s | copy µs | copy GB/s "
        "| % of copy BW | × vs SDPA | max err |\n"
    )
    head += "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    for r in rows:
        err = "" if r.max_err is None else f"{r.max_err:.1e}"
        head += (
            f"| {r.n} | {r.op} | {r.bits_per_coord} | {r.us} | {r.bytes_moved / 1e6:.1f} | {r.gbps} "
            f"| {r.copy_us} | {r.copy_gbps} "
            f"| {100 * r.roofline_frac:.0f}% | {r.speedup_vs_sdpa} | {err} |\n"
        )
    return head


def main() -> None:
    args = _parse()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
        os.environ["KVLAB_KERNELS"] = "triton"
    import torch

    if args.dry_run:
        device, dtype, lengths, name = (
            torch.device("cpu"),
            torch.float32,
            args.lengths or [200],
            "CPU (Triton interpreter, dry run)",
        )
    elif torch.cuda.is_available():
        device, dtype, lengths, name = (
            torch.device("cuda"),
            torch.bfloat16,
            args.lengths or list(LENGTHS),
            torch.cuda.get_device_name(),
        )
    else:
        sys.exit(
            "bench/kernels.py: no CUDA GPU here. It measures the Triton kernels on a GPU; run it on one "
            "(`python -m bench.kernels`), or check the script on the CPU with `python -m bench.kernels --dry-run`."
        )
    torch.manual_seed(0)
    timer = _timer(device)
    rows: list[Row] = []
    for i, n in enumerate(lengths):
        rows += bench_length(n, device, dtype, timer, check=i == 0)
        print(f"{n} tokens done", file=sys.stderr, flush=True)
    print(markdown(rows, name, str(dtype).replace("torch.", "")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "rows": [asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
