"""A plain PyTorch training loop fed by loadout, in the shape of pytorch/examples' imagenet/main.py.

The data comes from loadout's loader (worker processes that hand batches over through a shared-memory ring, a
device prefetcher, per-sample seeded augmentation); a checkpoint keeps the loader's position, so `--resume`
continues at the exact next sample, also mid-epoch; the doctor says after each epoch what bound it. Only loadout,
torch and torchvision are imported: the template (train/) is not needed.

    pip install .                                         # in a loadout checkout: loadout and its dependencies
    python train.py DIR --epochs 2 -b 64 -j 4             # DIR/train/<class>/<image>, DIR/val/<class>/<image>
    python train.py DIR --epochs 2 -b 64 -j 4 --resume checkpoint.pt

SIGTERM, SIGINT or SIGUSR1 (Slurm, Kubernetes, Ctrl-C) stops it at the next step with a checkpoint to resume from.
"""

import argparse
import logging

import torch
import torchvision
from torchvision.transforms import v2

import loadout

parser = argparse.ArgumentParser(description="A plain PyTorch loop on loadout's loader")
parser.add_argument("data", metavar="DIR", help="an image folder: DIR/train/<class>/<image>, DIR/val/...")
parser.add_argument("-a", "--arch", default="resnet18", help="a torchvision classifier (default: resnet18)")
parser.add_argument("-j", "--workers", default=4, type=int, help="loader processes (default: 4; 0: no ring)")
parser.add_argument("--epochs", default=90, type=int, help="epochs in all (default: 90)")
parser.add_argument("-b", "--batch-size", default=256, type=int, help="samples a batch (default: 256)")
parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, help="initial learning rate")
parser.add_argument("--momentum", default=0.9, type=float)
parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
parser.add_argument("--image-size", default=224, type=int, help="the side the model sees (default: 224)")
parser.add_argument("-p", "--print-freq", default=10, type=int, help="print every this many batches")
parser.add_argument("--seed", default=0, type=int, help="weights, order and augmentation follow from it")
parser.add_argument("--checkpoint", default="checkpoint.pt", help="where to save (default: checkpoint.pt)")
parser.add_argument("--resume", default="", metavar="PATH", help="continue from this checkpoint")
parser.add_argument("--max-steps", type=int, help="stop after this many steps in all, with a checkpoint")


class Augment:
    """The per-sample recipe loadout's workers run: uint8 images in and out (the prefetcher normalizes them on the
    device). `size`: the side of inputs stored square already (a cache, a packed set), None for files."""

    def train_transform(self, data, size=None):
        return v2.Compose([v2.RandomResizedCrop(data.image_size, antialias=True), v2.RandomHorizontalFlip()])

    def val_transform(self, data, size=None):
        return v2.Compose([v2.Resize(data.image_size * 256 // 224, antialias=True), v2.CenterCrop(data.image_size)])


def main():
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the loader's notes and the doctor's lines
    env = loadout.DistEnv()  # one process (DistEnv.from_env() reads torchrun's)
    loadout.seed_everything(args.seed, env)
    device = loadout.select_device("auto", env)

    # The data: the loader's settings, the plan they settle into (workers, ring slots, shared memory), two loaders.
    settings = loadout.DataConfig(image_size=args.image_size, batch_size=args.batch_size, num_workers=args.workers)
    plan = loadout.LoaderPlan.from_config(settings, env, device)
    sources = loadout.ImageFolderDataset(args.data, "train"), loadout.ImageFolderDataset(args.data, "val")
    data = loadout.build_data(settings, sources, Augment(), plan, env, device, seed=args.seed, epochs=args.epochs,
                              channels_last=False)
    if plan.num_workers:
        print(f"loader: {plan.num_workers} workers, a shared-memory ring of {plan.ring_slots} batches each "
              f"({plan.shm_bytes / 2**20:.1f} MiB with validation's)")

    model = torchvision.models.get_model(args.arch, num_classes=len(sources[0].classes)).to(device)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    # The checkpoint's parts: anything with state_dict() / load_state_dict(). The loader's position says where the
    # training stream stands (epoch, batch), so it is the run's progress too.
    parts = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": data.positions(env)}
    if args.resume:
        state = loadout.load_checkpoint(args.resume)
        for name, part in parts.items():
            part.load_state_dict(state[name])
        print(f"resumed from {args.resume}: epoch {data.train.epoch + 1}, batch {data.train.batch + 1} next")
    doctor = loadout.Doctor(loadout.Machine.of(settings, data.plan, data.source, device))

    with data, loadout.StopSignal() as stop:  # the workers end with the block; a signal is only noted
        for epoch in range(data.train.epoch, args.epochs):
            data.set_epoch(epoch)
            finished = train(data, model, criterion, optimizer, epoch, args, doctor, stop, device)
            if finished:
                val_loss, acc1 = validate(data, model, criterion)
                print(f"epoch {epoch + 1}: val loss {val_loss:.6f}, acc@1 {acc1:.2%}")
                scheduler.step()
            save(parts, args.checkpoint)
            if (stop.signum or out_of_steps(data, args.max_steps)) and data.train.epoch < args.epochs:
                print(f"stopped: --resume {args.checkpoint} continues at epoch {data.train.epoch + 1}, batch "
                      f"{data.train.batch + 1}")
                return


def train(data, model, criterion, optimizer, epoch, args, doctor, stop, device) -> bool:
    """One epoch, or its rest after a resume; False when it stopped early (a signal, --max-steps)."""
    model.train()
    meter, clocks = loadout.EpochMeter(device), data.train.stages.snapshot()  # the doctor reads both
    for number, batch in enumerate(data.train, start=data.train.batch + 1):  # on the device, normalized
        meter.waited()
        if len(batch):  # empty when every sample of it was unreadable (skipped, counted in batch.bad)
            loss = criterion(model(batch.images), batch.targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            meter.stepped(len(batch), loss.detach())
            if number % args.print_freq == 0:
                print(f"epoch {epoch + 1} batch {number}/{len(data.train)} loss {loss.item():.6f}")
        if number < len(data.train) and (stop.signum or out_of_steps(data, args.max_steps)):
            return False  # mid-epoch: the checkpoint keeps the position; at its end, the epoch finishes first
    record = meter.summary()
    spent = {stage: seconds - clocks[stage] for stage, seconds in data.train.stages.snapshot().items()}
    doctor.examine(spent, record)  # logs where a sample's time went and one line naming the bound and its fix
    print(f"epoch {epoch + 1}: train loss {record['train_loss']:.6f}, {record['images_per_s']:.0f} images/s, "
          f"waited {record['data_wait_frac']:.0%} of the epoch for data")
    return True


def validate(data, model, criterion) -> tuple[float, float]:
    model.eval()
    loss = correct = seen = 0
    with torch.no_grad():
        for batch in data.val:
            if len(batch):
                output = model(batch.images)
                loss += criterion(output, batch.targets).item() * len(batch)
                correct += (output.argmax(1) == batch.targets).sum().item()
                seen += len(batch)
    return loss / max(seen, 1), correct / max(seen, 1)


def out_of_steps(data, max_steps) -> bool:
    """Whether the training stream's position (epoch, batch: one step a batch) has reached --max-steps."""
    return max_steps is not None and data.train.epoch * len(data.train) + data.train.batch >= max_steps


def save(parts, path):
    """Every rank's loader position gathered, then all parts written atomically (a kill mid-write leaves the
    previous file whole)."""
    parts["loader"].gather(mid_epoch=True)  # at an epoch's end too: the position then names the next epoch
    loadout.save_checkpoint(parts, path)


if __name__ == "__main__":
    main()
