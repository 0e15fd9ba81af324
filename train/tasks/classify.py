"""Image classification (the ConvNet family) on `digits` (the embedded default) or an image folder:
cross-entropy with label smoothing, top-1/top-5, and timm's training recipe as data keys (docs/convnet.md)."""
from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Optional
import importlib.util
import random

import torch
import torch.nn.functional as F

import zoo
from zoo.blocks.chunked_ce import distillation_loss
from zoo.config import ROPE_AUGMENT_KEYS, VIT_ARCHS, ConfigError, bounded, fail
from zoo.convnet.preprocess import Preprocess
from zoo.weights import hf_vit, timm_convnet, timm_vit

from ..data import DataError
from ..data.images import (FolderImages, augment_seeded, auto_augment_op, collate_images, digits_dataset,
                           epoch_positions, folder_channels, mix_batch, normalization, random_erase, random_shift,
                           scan_image_folder)
from ..eval import per_class_table
from ..step import eval_mode
from . import Task


@dataclass
class ImageDataConfig:
    path: str = "digits"                    # `digits` (embedded: scikit-learn's 8x8 digits, upsampled) or an image
                                            # folder `root/<class>/<images>`
    val_path: Optional[str] = None          # a val folder with the same class folders; null: `root/val` when
                                            # `root/train` and `root/val` exist, else a split
    val_fraction: float = bounded(0.1, gt=0, lt=1)  # held out per class without a val folder (also the digits split)
    image_size: Optional[int] = bounded(None, ge=8)  # crop size; null: 32 for digits, 224 for folders
    crop_pct: float = bounded(0.875, gt=0, le=1)  # eval: resize the short side to `image_size / crop_pct`,
                                            # centre-crop `image_size`
    scale: tuple[float, float] = (0.08, 1.0)   # train: random-resized-crop area range
    ratio: tuple[float, float] = (0.75, 1.3333333)  # train: aspect-ratio range
    hflip: float = bounded(0.5, ge=0, le=1)  # train: horizontal flip probability (folders)
    shift: int = bounded(2, ge=0)           # train: random translation in pixels (digits; no flips for digits)
    mean: Optional[list[float]] = None      # null: ImageNet's (RGB) / 0.5 (digits, grey)
    std: Optional[list[float]] = None       # null: ImageNet's for RGB folders, 0.449/0.226 grey, 0.5/0.5 digits
    label_smoothing: float = bounded(0.1, ge=0, lt=1)  # cross-entropy label smoothing (of the mixed targets too)
    auto_augment: Literal["none", "randaugment", "trivialaugment"] = "none"  # train: torchvision's RandAugment or
                                            # TrivialAugmentWide on each image after the crop (the `convnet` extra)
    randaugment_ops: int = bounded(2, gt=0)  # RandAugment: operations per image
    randaugment_magnitude: int = bounded(9, ge=0, le=30)  # RandAugment: magnitude, of 31 bins
    random_erasing: float = bounded(0.0, ge=0, le=1)  # train: probability that an image gets a box (2-33% of its
                                            # area) of N(0, 1) noise, after normalisation (timm's `reprob`)
    mixup_alpha: float = bounded(0.0, ge=0)  # Mixup: lam ~ Beta(alpha, alpha) per batch, images and targets mixed
                                            # with the batch reversed; 0 = off (timm's recipe: 0.8)
    cutmix_alpha: float = bounded(0.0, ge=0)  # CutMix: a box of area (1 - lam) from the batch reversed; 0 = off
                                            # (timm's recipe: 1.0)
    mix_prob: float = bounded(1.0, ge=0, le=1)  # probability that a batch is mixed when Mixup or CutMix is on
    mix_switch_prob: float = bounded(0.5, ge=0, le=1)  # with both on: probability of CutMix rather than Mixup
    num_workers: int = bounded(2, ge=0)     # DataLoader worker processes decoding images (folders)
    pin_memory: Optional[bool] = None       # null: on when the device is CUDA
    eval_images: Optional[int] = bounded(None, gt=0)  # evaluate on a fixed seeded subset of this many validation images
    ema_bn_batches: int = bounded(8, ge=0)  # BN recalibration batches for the EMA model; 0 = off

    def validate(self, source, prefix="data."):
        if not self.path:
            raise fail(source, prefix + "path", "must not be empty")
        if not 0.0 < self.scale[0] <= self.scale[1] <= 1.0:
            raise fail(source, prefix + "scale", f"must be 0 < min <= max <= 1, got {list(self.scale)}")
        if not 0.0 < self.ratio[0] <= self.ratio[1]:
            raise fail(source, prefix + "ratio", f"must be 0 < min <= max, got {list(self.ratio)}")
        if (self.mean is None) != (self.std is None) or (self.mean and len(self.mean) != len(self.std)):
            raise fail(source, prefix + "std", "and data.mean must both be set, with one value per channel")
        if self.std and any(s <= 0 for s in self.std):
            raise fail(source, prefix + "std", f"must be > 0, got {self.std}")


class ClassifyTask(Task):
    DataConfig, unit = ImageDataConfig, "images"
    _drops = None  # the DropPath modules of model.drop_path_mode=batch (found at the first training batch)

    @staticmethod
    def validate_config(cfg):
        d, m = cfg.data, cfg.model
        if d.mean is not None and len(d.mean) not in (1, m.in_chans):
            raise ConfigError(f"{cfg.source}: data.mean has {len(d.mean)} values for model.in_chans={m.in_chans}")
        if d.auto_augment != "none" and importlib.util.find_spec("torchvision") is None:
            raise ConfigError(f"{cfg.source}: data.auto_augment={d.auto_augment} needs torchvision: "
                              f"pip install -e '.[convnet]'")
        if d.path != "digits" and m.in_chans not in (1, 3) and cfg.train.init_from is None:
            raise ConfigError(f"{cfg.source}: model.in_chans={m.in_chans}: image folders give 1 (grey) or 3 (RGB) "
                              f"channels")

    def setup(self):
        cfg, d = self.cfg, self.cfg.data
        self.pretrained, self.bad, self.digits = None, set(), d.path == "digits"
        self.augment = auto_augment_op(d.auto_augment, d.randaugment_ops, d.randaugment_magnitude)
        self.size = d.image_size or (32 if self.digits else 224)
        if self.digits:
            self.classes, seen = [str(i) for i in range(10)], None
        else:
            train_s, val_s = self._scan(Path(d.path), d.val_path)
            seen = folder_channels(p for p, _ in train_s)
        self.model_cfg = self._fit_to_data(seen)
        if cfg.train.init_from:  # the architecture (and input channels) come from the weights
            fmt = timm_vit if cfg.family == "vit" else timm_convnet  # the family's timm layout
            regularise = {k: getattr(cfg.model, k) for k in ("drop_rate", "drop_path_rate", "patch_drop_rate")
                          if hasattr(cfg.model, k)}  # the run's, not the file's
            regularise.update({k: v for k in ROPE_AUGMENT_KEYS if (v := getattr(cfg.model, k, None)) is not None})
            # DINOv3's RoPE augmentation: the file's, unless the run sets it (0: off)

            def read(path):
                if fmt is timm_vit and hf_vit.detect(path):  # a Hugging Face DINOv3 / SigLIP 2 folder
                    model = hf_vit.load(path, num_classes=0, **regularise)  # its head comes fresh in build_model
                    return model.state_dict(), replace(model.config, num_classes=self.model_cfg.num_classes)
                sd = timm_convnet.read_state_dict(path)
                sd = timm_vit.from_timm(sd) if fmt is timm_vit else sd  # EVA-02's and SwiGLU's names: Zoo's
                named, base = timm_convnet.saved_config(path, VIT_ARCHS if fmt is timm_vit else None)
                return sd, fmt.config_from_state_dict(sd, named, str(path), base,
                                                      num_classes=self.model_cfg.num_classes, **regularise)
            asked, (self.pretrained, self.model_cfg) = self.model_cfg, self.load_pretrained(read, say=False)
            self._say_overruled(asked)
        channels, patch = self.model_cfg.in_chans, cfg.family == "vit" and self.model_cfg.resolved["patch_size"]
        if patch and self.size % patch:
            raise ConfigError(f"{cfg.source}: data.image_size={self.size}: not a multiple of the ViT's patch size "
                              f"{patch}, so its position table cannot be laid out on the image")
        if self.digits:
            try:
                x, y = digits_dataset("train", self.size, channels, d.val_fraction, cfg.train.seed)
                xv, yv = digits_dataset("val", self.size, channels, d.val_fraction, cfg.train.seed)
            except ImportError as e:
                raise DataError(f"data.path=digits: {e}") from None
            self.train_x, self.train_y = x.to(self.device), y.to(self.device)
            self.val_x, self.val_y = xv.to(self.device), yv.to(self.device)
            self.n_train = len(y)
        else:
            kw = dict(size=self.size, channels=channels, scale=d.scale, ratio=d.ratio, hflip=d.hflip, crop_pct=d.crop_pct)
            self.train_set = FolderImages(train_s, train=True, augment=self.augment, **kw)
            self.train_eval_set = FolderImages(train_s, train=False, **kw)  # for BatchNorm recalibration
            self.val_set = FolderImages(val_s, train=False, **kw)
            self.n_train = len(train_s)
        mean, std = normalization(d, channels)
        self.preprocess = Preprocess(self.size, channels, tuple(mean), tuple(std), 1.0 if self.digits else d.crop_pct,
                                     tuple(self.classes))  # what the run folder needs to be used alone
        self.norm_mean = torch.tensor(mean, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        self.norm_inv_std = 1.0 / torch.tensor(std, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        self.pin = d.pin_memory if d.pin_memory is not None else self.device.type == "cuda"
        self._iter, self._next = None, None
        self.log(f"data: {d.path}: {self.n_train} train / {self.n_val} val images, {len(self.classes)} classes, "
                 f"{self.size}x{self.size}, {channels} channel(s)")

    def _say_overruled(self, asked):
        """Log the model keys the run set that train.init_from's weights overrule (their architecture wins)."""
        from dataclasses import fields
        gone = [f"model.{f.name}={v}" for f in fields(asked) if (v := getattr(asked, f.name)) is not None
                and v != getattr(self.model_cfg, f.name)]
        if gone:
            self.log(f"model: {', '.join(gone)} not used: the architecture is train.init_from's")

    def _fit_to_data(self, channels: Optional[int]):
        """The model config with what the data decides where the config says otherwise: the class count,
        and an image folder's channels (1 when every image is grey; pretrained weights keep theirs)."""
        m, over = self.cfg.model, {"num_classes": len(self.classes)}
        if channels is not None and not self.cfg.train.init_from:
            over["in_chans"] = channels
        over = {k: v for k, v in over.items() if getattr(m, k) != v}
        if over:
            self.log("model: " + ", ".join(f"model.{k}={getattr(m, k)} -> {v}" for k, v in over.items())
                     + f", as {self.cfg.data.path} has them")
        return replace(m, **over)

    @property
    def n_val(self) -> int:
        return len(self.val_y) if self.digits else len(self.val_set)

    def _scan(self, root: Path, val_path: Optional[str]):
        try:
            if val_path is None and (root / "train").is_dir() and (root / "val").is_dir():
                root, val_path = root / "train", str(root / "val")
            self.classes, samples = scan_image_folder(root)
            if val_path is not None:
                _, val = scan_image_folder(val_path, self.classes)
                return samples, val
        except (ValueError, FileNotFoundError) as e:
            raise DataError(str(e)) from None
        g, train, val = torch.Generator().manual_seed(self.cfg.train.seed), [], []
        for _, group in itertools.groupby(samples, key=lambda s: s[1]):  # the samples come class by class
            items = list(group)
            order = torch.randperm(len(items), generator=g).tolist()
            k = max(1, round(len(items) * self.cfg.data.val_fraction)) if len(items) > 1 else 0
            val += [items[i] for i in order[:k]]
            train += [items[i] for i in order[k:]]
        if not val:
            raise DataError(f"{root}: too few images to hold out a validation set (set data.val_path)")
        return train, val

    def _report(self, bad: list):
        for b in bad:
            if b not in self.bad:
                self.bad.add(b)
                self.log(f"data: unreadable image skipped: {b} ({len(self.bad)} so far)")

    def _loader(self, dataset, batch_sampler):
        d = self.cfg.data
        return torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler, num_workers=d.num_workers,
                                           collate_fn=collate_images, pin_memory=self.pin,
                                           prefetch_factor=4 if d.num_workers else None)

    def train_batch(self, step, micro):
        t = self.cfg.train
        B = self.global_rows()  # one global micro-batch; this rank trains on its own rows of it
        pos, g = (step * t.grad_accum + micro) * B, self.batch_generator(step, micro)
        if self.digits:
            keys = epoch_positions(self.n_train, t.seed, pos, B)
            idx = torch.tensor([i for i, _ in keys], device=self.device)
            x, y = random_shift(self.train_x[idx], self.cfg.data.shift, g), self.train_y[idx]
            recipe_seed = self._recipe_seed(g)
            if self.augment is not None:  # on uint8, each image seeded by its sample seed
                x = augment_seeded(self.augment, (x * 255).round_().to(torch.uint8), [s for _, s in keys]).float() / 255
            return self.own_rows(x), self.own_rows(y), recipe_seed
        recipe_seed = self._recipe_seed(g)
        if self._next != (step, micro):  # first batch, or a resume / jump: restart the stream there
            stream = (self.own_rows(epoch_positions(self.n_train, t.seed, p, B)) for p in itertools.count(pos, B))
            self._iter = iter(self._loader(self.train_set, stream))  # (index, augmentation seed) batches, forever
        self._next = (step, micro + 1) if micro + 1 < t.grad_accum else (step + 1, 0)
        x, y, bad = next(self._iter)
        self._report(bad)
        if x is None:
            raise DataError(f"{self.cfg.data.path}: no readable image in the batch of step {step + 1} "
                            f"({len(self.bad)} unreadable so far)")
        return x, y, recipe_seed

    def _recipe_seed(self, g: torch.Generator) -> int:
        """The seed of a micro-batch's erasing and mixing, drawn from its (seed, step, micro) generator."""
        return int(torch.randint(2 ** 62, (1,), generator=g)) + self.rank

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 (B, C, H, W) in 0..255, or floats in [0, 1] -> float32 (x - mean) / std (same memory format)."""
        if x.dtype == torch.uint8:
            return (x.float() - self.norm_mean * 255.0) * (self.norm_inv_std / 255.0)
        return (x.float() - self.norm_mean) * self.norm_inv_std

    def build_model(self):
        model = self.model = zoo.build(self.model_cfg)
        if self.cfg.train.teacher and getattr(model, "dist_token", None) is not None:
            model.set_distilled_training()  # DeiT: its two heads apart in training, each learning its own target
        if self.pretrained is None:
            return model
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.load_pretrained(lambda path: timm_convnet.load_into(model, self.pretrained, str(path)))
        for w in caught:
            self.log(f"model: {w.message}")
        self.log(f"model: {timm_convnet.describe(self.model_cfg)}")
        self.pretrained = None
        return model

    def seed_batch_drops(self, model, seed: int):
        """model.drop_path_mode=batch: the blocks a micro-batch drops are drawn from a generator seeded by its
        (seed, step, micro) draw, the same on every rank, so that all ranks drop the blocks one process drops."""
        if self._drops is None:
            from zoo.blocks.drop_path import DropPath
            self._drops = [m for m in model.modules() if isinstance(m, DropPath) and m.mode == "batch"]
            g = torch.Generator(self.device)
            for m in self._drops:
                m.generator = g
        if self._drops:
            self._drops[0].generator.manual_seed(seed)

    def recipe(self, x: torch.Tensor, y: torch.Tensor, seed: int):
        """Random erasing, then Mixup / CutMix, of a normalised training batch, all drawn from `seed`:
        -> (images, targets: labels (B,), or soft targets (B, num_classes) when mixing is on)."""
        d, rng = self.cfg.data, random.Random(seed)
        if d.random_erasing > 0:
            x = random_erase(x, d.random_erasing, rng)
        if d.mixup_alpha > 0 or d.cutmix_alpha > 0:
            x, y, _ = mix_batch(x, y, self.model_cfg.num_classes, rng, d.mixup_alpha, d.cutmix_alpha, d.mix_prob,
                                d.mix_switch_prob, d.label_smoothing)
        return x, y

    def check_teacher(self, teacher, model):
        classes = getattr(getattr(teacher, "config", None), "num_classes", None)
        if classes is None:
            return f"a {type(teacher).__name__} is not a classifier"
        if classes != model.config.num_classes:
            return f"its num_classes={classes} is not the student's {model.config.num_classes}"
        if getattr(teacher.config, "in_chans", model.config.in_chans) != model.config.in_chans:
            return f"its in_chans={teacher.config.in_chans} is not the student's {model.config.in_chans}"
        return None

    def loss(self, model, batch):
        """Cross-entropy with label smoothing, against Mixup / CutMix's soft targets when on; with
        train.teacher the distillation loss. Training batches carry their recipe seed; example ones do not."""
        x, y = self.normalize(batch[0]), batch[1]
        n = y.numel()
        if len(batch) > 2:
            self.seed_batch_drops(model, batch[2] - self.rank)
            x, y = self.recipe(x, y, batch[2])
        out = model(x)
        if self.teacher is not None:
            with torch.no_grad():
                teacher_logits = self.teacher(x).float()
            return self.distill(out, teacher_logits, y), n
        return self.label_loss(out.float(), y), n

    def label_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Cross-entropy with label smoothing, or against soft targets y (B, num_classes) (Mixup / CutMix's)."""
        if y.dim() == 2:
            return -(y * logits.log_softmax(-1)).sum(-1).mean()
        return F.cross_entropy(logits, y, label_smoothing=self.cfg.data.label_smoothing)

    def distill(self, out, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(1 - kd_alpha) * the labels' loss + kd_alpha * the teacher's (logits z): T^2 KL at kd_temperature
        (`soft`) or cross-entropy on its top class (`hard`). A distilled ViT in training gives (class, distillation)
        logits, the labels' loss on the first and the teacher's on the second (DeiT); a one-head student's soft loss
        on labels stays Hinton's (distillation_loss, its cross-entropy unsmoothed)."""
        t, two = self.cfg.train, isinstance(out, tuple)
        cls, dist = (o.float() for o in (out if two else (out, out)))
        if t.kd_kind == "soft" and not two and y.dim() == 1:
            return distillation_loss(cls, z, y, t.kd_alpha, t.kd_temperature)
        if t.kd_kind == "hard":
            kd = F.cross_entropy(dist, z.argmax(-1))
        else:
            T = t.kd_temperature
            kd = T * T * F.kl_div((dist / T).log_softmax(-1), (z / T).log_softmax(-1), reduction="batchmean",
                                  log_target=True)
        return (1 - t.kd_alpha) * self.label_loss(cls, y) + t.kd_alpha * kd

    def example_batch(self, model, batch_size):
        d, c = self.cfg.data, model.config.in_chans
        size = d.image_size or (32 if d.path == "digits" else 224)
        if getattr(self, "norm_mean", None) is None:
            self.norm_mean = torch.full((1, c, 1, 1), 0.5, device=self.device)
            self.norm_inv_std = torch.full((1, c, 1, 1), 2.0, device=self.device)
        x = torch.zeros(batch_size, c, size, size, device=self.device,  # digits: floats; folders: uint8 crops
                        dtype=torch.float32 if d.path == "digits" else torch.uint8)
        return x, torch.zeros(batch_size, dtype=torch.long, device=self.device)

    def _batches(self, split: str, keys: list):
        """(images, labels) of a split's samples `keys` [(index, seed)], train.batch_size at a time, on the
        device, un-augmented (unreadable images reported and left out)."""
        B = self.cfg.train.batch_size
        fmt = torch.channels_last if self.cfg.train.channels_last else torch.contiguous_format
        if self.digits:
            images, labels = (self.train_x, self.train_y) if split == "train" else (self.val_x, self.val_y)
            idx = torch.tensor([i for i, _ in keys], dtype=torch.long, device=self.device)
            batches = ((images[idx[i:i + B]], labels[idx[i:i + B]], []) for i in range(0, len(idx), B))
        else:
            dataset = self.train_eval_set if split == "train" else self.val_set
            batches = self._loader(dataset, [keys[i:i + B] for i in range(0, len(keys), B)])
        for x, y, bad in batches:
            self._report(bad)
            if x is not None:
                yield (x.to(self.device, non_blocking=True).contiguous(memory_format=fmt),
                       y.to(self.device, non_blocking=True))

    def _val_batches(self):
        """(images, labels) over the validation set, or a fixed seeded subset of data.eval_images of it."""
        n = min(self.cfg.data.eval_images or self.n_val, self.n_val)
        order = torch.randperm(self.n_val, generator=torch.Generator().manual_seed(self.cfg.train.seed)).tolist()
        return self._batches("val", [(i, 0) for i in (sorted(order[:n]) if n < self.n_val else range(n))])

    @torch.no_grad()
    def predict(self, model):
        """(logits (N, num_classes) float32, labels (N,)) over the validation set, in eval mode."""
        logits, labels = [], []
        with eval_mode(model):
            for x, y in self._val_batches():
                with self.autocast():
                    logits.append(model(self.normalize(x)).float())
                labels.append(y)
        if not logits:
            raise DataError(f"{self.cfg.data.path}: no readable validation image")
        return torch.cat(logits), torch.cat(labels)

    @torch.no_grad()
    def recalibrate_bn(self, model, n_batches: int):
        """Recompute every BatchNorm's running statistics over n_batches of un-augmented training images
        (Wu & Johnson, "Rethinking 'Batch' in BatchNorm", 2021): an EMA of the weights needs it."""
        bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        if not bns or n_batches <= 0:
            return
        t = self.cfg.train
        keys = epoch_positions(self.n_train, t.seed + 1, 0, min(n_batches * t.batch_size, self.n_train))
        saved = [bn.momentum for bn in bns]
        with eval_mode(model):
            for bn in bns:  # the BatchNorm layers alone in training mode
                bn.reset_running_stats()
                bn.momentum = None  # cumulative average
                bn.train()
            for x, _ in self._batches("train", keys):
                with self.autocast():
                    model(self.normalize(x))
        for bn, m in zip(bns, saved):
            bn.momentum = m

    def evaluate(self, model):
        own = getattr(self, "model", None)
        if own is not None and model is not own and self.cfg.data.ema_bn_batches:  # the loop's EMA copy
            self.recalibrate_bn(model, self.cfg.data.ema_bn_batches)
        logits, y = self.predict(model)
        k = min(5, logits.shape[1])
        hit = logits.topk(k, dim=1).indices == y[:, None]
        out = {"val_loss": F.cross_entropy(logits, y).item(), "val_acc1": hit[:, 0].float().mean().item()}
        if k == 5:
            out["val_acc5"] = hit.any(1).float().mean().item()
        if self.bad:
            out["unreadable_images"] = float(len(self.bad))
        return out

    def flops_per_item(self, model):
        return model.flops_per_image(self.size)

    def save_files(self, out_dir):
        self.preprocess.save(out_dir)

    def samples(self, model, out_dir):
        """Per-class validation accuracy of `model` (the EMA's weights when the run keeps an EMA) in
        out_dir/per_class.txt, saying which; the log shows the worst and best five."""
        logits, y = self.predict(model)
        weights = "model_ema.safetensors (EMA)" if self.cfg.train.ema_decay else "model.safetensors"
        rows, text, head, total = per_class_table(logits.argmax(1), y, self.classes, weights)
        (Path(out_dir) / "per_class.txt").write_text(text + "\n")
        lines = text.split("\n")[2:-1]  # the table's line of each class
        if len(rows) > 20:  # the log shows the five worst and five best classes
            order = sorted(range(len(rows)), key=lambda i: rows[i][2])
            lines = [lines[i] for i in order[:5]] + [f"{'...':>24}"] + [lines[i] for i in order[-5:]]
        return "\n".join([head, *lines, total])

    def export(self, model, out_dir):
        """Fine-tuned from pretrained weights: write them back in the layout (and file type) they came in; a ViT
        from a Hugging Face folder in timm's (DINOv3ViTModel and Siglip2VisionModel hold no classifier)."""
        src = self.cfg.train.init_from
        if not src:
            return None  # model.safetensors, written by the loop, already has the timm/torchvision keys
        path = Path(out_dir) / "export" / (Path(src).name + ("-timm" if hf_vit.detect(src) else ""))
        zoo.save_pretrained(model, path)
        return str(path)
