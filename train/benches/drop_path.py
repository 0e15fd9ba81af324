"""Stochastic depth that skips the work: ResNet training steps with the dropped samples' branches
computed and zeroed (`drop_path_mode: mask`) against never computed (`skip`: kept rows gathered,
run, scattered back; `batch`: a whole block dropped for the batch, Huang et al. 2016).

    python train/bench.py drop-path                       # resnet50, 32 x 3 x 64 x 64, rates 0.1 0.3 0.5
    python train/bench.py drop-path --rates 0.2 --size 128 --rounds 8

Each rate is the last block's (linear from 0 at the first block, as in the paper); every side has
the same weights, batch and drop rate, channels-last, fp32 (or `--precision`), SGD step included.
Timing: train/benches/harness.py's alternating rounds; the table gives each mode's images/s
(best round) and the paired median of skip's (and batch's) speed over mask's. Writes the table's
numbers to `--json` (train/benches/drop_path.json by default); docs/convnet.md quotes them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.benches import harness  # noqa: E402
from train.benches.resnet import Side  # noqa: E402

MODES = ("mask", "skip", "batch")


def main(argv=None):
    import zoo
    from zoo.config import ConvNetConfig
    ap = harness.parser("drop-path", __doc__, precision="fp32")
    ap.add_argument("--arch", default="resnet50")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=64, help="image height and width")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.3, 0.5])
    ap.add_argument("--steps", type=harness.positive_int, default=2, help="timed steps per round")
    ap.add_argument("--json", default=str(Path(__file__).with_suffix(".json")))
    args = ap.parse_args(argv)
    harness.setup(args)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=g).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    print(f"drop-path: {args.arch}, batch {args.batch} x 3 x {args.size} x {args.size}, channels-last, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds of {args.steps} steps")
    rows, out = [], {"arch": args.arch, "batch": args.batch, "size": args.size, "rounds": args.rounds, "results": []}
    for p in args.precision:
        for rate in args.rates:
            sides = {}
            for mode in MODES:
                torch.manual_seed(0)
                cfg = ConvNetConfig(arch=args.arch, num_classes=10, drop_path_rate=rate, drop_path_mode=mode)
                sides[mode] = Side(mode, zoo.build(cfg).train().to(memory_format=torch.channels_last))
                sides[mode].step(x, y, p)
            r = harness.run_rounds({m: (lambda s=s: s.step(x, y, p)) for m, s in sides.items()}, args.rounds,
                                   calls=args.steps)
            res = {"precision": p, "rate": rate, **{f"{m}_img_s": args.batch / r.best(m) for m in MODES},
                   **{f"{m}_over_mask": r.paired(m, "mask")._asdict() for m in ("skip", "batch")}}
            out["results"].append(res)
            rows.append([p, rate, *(f"{res[f'{m}_img_s']:.1f}" for m in MODES), str(r.paired("skip", "mask")),
                         str(r.paired("batch", "mask"))])
            print("  " + " | ".join(map(str, rows[-1])), flush=True)
    print()
    harness.print_table(["precision", "last block's rate", "mask img/s", "skip img/s", "batch img/s",
                         "skip / mask (paired median, range)", "batch / mask"], rows)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
