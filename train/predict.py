"""Classify images with a ConvNet run folder: the top classes of each image, with probabilities.

    python train/predict.py DIR IMAGE_OR_FOLDER [...] [--top 5] [--ema] [--json]

DIR: a ConvNet run folder of train/run.py (model.safetensors, preprocess.json with the class names
and the evaluation preprocessing). A folder argument stands for every image under it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch


def load(folder, ema: bool = False):
    """(model in eval mode, its Preprocess) of a ConvNet run folder; ema: the EMA's weights."""
    import zoo
    from zoo.convnet.preprocess import Preprocess
    weights = Path(folder) / ("model_ema.safetensors" if ema else "model.safetensors")
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: no such file (a ConvNet run folder of train/run.py has it)")
    prep = Preprocess.from_folder(folder)
    return zoo.from_pretrained(weights, num_classes=len(prep.classes)).eval(), prep


@torch.no_grad()
def probabilities(model, prep, paths: list, batch: int = 64) -> torch.Tensor:
    """Softmax over the classes, (N, classes), of the image files `paths`."""
    return torch.cat([model(prep(paths[i:i + batch])).float().softmax(-1) for i in range(0, len(paths), batch)])


def image_files(args) -> list[Path]:
    from train.data.images import IMAGE_EXTENSIONS
    out = []
    for a in map(Path, args):
        if a.is_dir():
            found = sorted(p for p in a.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)
            if not found:
                raise FileNotFoundError(f"{a}: no images found")
            out += found
        elif a.is_file():
            out.append(a)
        else:
            raise FileNotFoundError(f"{a}: no such image or folder")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python train/predict.py", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="a ConvNet run folder")
    p.add_argument("images", nargs="+", help="image files or folders of them")
    p.add_argument("--top", type=int, default=5, help="how many classes per image (default 5)")
    p.add_argument("--ema", action="store_true", help="the EMA's weights (model_ema.safetensors)")
    p.add_argument("--json", action="store_true", help="one JSON object per image")
    args = p.parse_args(argv)
    try:
        if args.top < 1:
            raise ValueError(f"--top must be >= 1, got {args.top}")
        model, prep = load(args.dir, args.ema)
        paths = image_files(args.images)
        probs = probabilities(model, prep, paths)
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    k = min(args.top, probs.shape[1])
    for path, row in zip(paths, probs):
        top = row.topk(k)
        best = [(prep.classes[i], round(float(q), 4)) for q, i in zip(top.values, top.indices)]
        print(json.dumps({"image": str(path), "top": best}) if args.json else
              f"{path}: " + ", ".join(f"{name} {q:.3f}" for name, q in best))
    return 0


if __name__ == "__main__":
    sys.exit(main())
