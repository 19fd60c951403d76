"""ImageNet training with mixed precision: NVIDIA Apex's ``examples/imagenet/main_amp.py``
on mixedprec.

The script is written as the Apex recipe was (same flags, same loop, same log lines)
against :mod:`mixedprec.amp`; the only change to an Apex-era script is the imports:

    Apex                                               here
    from apex import amp                               from mixedprec import amp
    from apex.parallel import DistributedDataParallel  from mixedprec.parallel import ...
    from apex.fp16_utils import to_python_float        from mixedprec.fp16_utils import ...

(The unmodified Apex script also runs: ``python -m mixedprec.apex main_amp.py ...``.)

Additions: synthetic data of ImageNet's shapes when no data directory is given
(``--synthetic-size``, ``--image-size``, ``--num-classes``), ``--num-batches`` to cut
epochs short, CPU training (gloo for multi-process), ``--bf16``, ``--fused-sgd``, a
tqdm progress bar per epoch, and the amp state in checkpoints.

    python main_amp.py -a resnet50 -b 224 --opt-level O2 /data/imagenet   # one GPU
    torchrun --nproc_per_node=8 main_amp.py -a resnet50 --opt-level O2 /data/imagenet
    python main_amp.py -a resnet18 -b 8 --image-size 64 --num-batches 5   # synthetic
"""

import argparse
import gc
import os
import shutil
import time

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.nn as nn
import torch.utils.data
import torch.utils.data.distributed
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms
from tqdm import tqdm

import mixedprec
from mixedprec import amp
from mixedprec.fp16_utils import to_python_float
from mixedprec.parallel import DistributedDataParallel as DDP
from mixedprec.parallel import convert_syncbn_model

MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)

best_prec1 = 0
args = None


def fast_collate(batch, memory_format):
    """uint8 NCHW batch from PIL images or uint8 CHW tensors (Apex's fast_collate:
    normalisation happens later, on the device)."""
    imgs = [img[0] for img in batch]
    targets = torch.tensor([target[1] for target in batch], dtype=torch.int64)
    if isinstance(imgs[0], torch.Tensor):
        return torch.stack(imgs).contiguous(memory_format=memory_format), targets
    w, h = imgs[0].size
    tensor = torch.zeros((len(imgs), 3, h, w), dtype=torch.uint8).contiguous(
        memory_format=memory_format)
    for i, img in enumerate(imgs):
        nump_array = np.asarray(img, dtype=np.uint8)
        if nump_array.ndim < 3:
            nump_array = np.expand_dims(nump_array, axis=-1)
        nump_array = np.rollaxis(nump_array, 2)
        tensor[i] += torch.from_numpy(nump_array)
    return tensor, targets


class SyntheticImageNet(torch.utils.data.Dataset):
    """Random uint8 images and labels of ImageNet's shapes, the same for every worker
    and process (each item is drawn from a generator seeded with its index)."""

    def __init__(self, size, image_size, num_classes, seed):
        self.size, self.image_size, self.num_classes, self.seed = (
            size, image_size, num_classes, seed)

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.randint(0, 256, (3, self.image_size, self.image_size),
                              dtype=torch.uint8, generator=g)
        target = int(torch.randint(0, self.num_classes, (1,), generator=g))
        return image, target


def parse():
    model_names = sorted(models.list_models(module=models))

    parser = argparse.ArgumentParser(description="PyTorch ImageNet Training (mixedprec.amp)")
    parser.add_argument("data", metavar="DIR", nargs="?", default=None,
                        help="path to dataset (train/ and val/ ImageFolders); synthetic data "
                             "when omitted")
    parser.add_argument("--arch", "-a", metavar="ARCH", default="resnet18",
                        choices=model_names,
                        help="model architecture: " + " | ".join(model_names)
                        + " (default: resnet18)")
    parser.add_argument("-j", "--workers", default=4, type=int, metavar="N",
                        help="number of data loading workers (default: 4)")
    parser.add_argument("--epochs", default=90, type=int, metavar="N",
                        help="number of total epochs to run")
    parser.add_argument("--start-epoch", default=0, type=int, metavar="N",
                        help="manual epoch number (useful on restarts)")
    parser.add_argument("-b", "--batch-size", default=256, type=int, metavar="N",
                        help="mini-batch size per process (default: 256)")
    parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, metavar="LR",
                        help="Initial learning rate. Will be scaled by <global batch size>/256: "
                             "args.lr = args.lr*float(args.batch_size*args.world_size)/256. "
                             "A warmup schedule will also be applied over the first 5 epochs.")
    parser.add_argument("--momentum", default=0.9, type=float, metavar="M", help="momentum")
    parser.add_argument("--weight-decay", "--wd", default=1e-4, type=float, metavar="W",
                        help="weight decay (default: 1e-4)")
    parser.add_argument("--print-freq", "-p", default=10, type=int, metavar="N",
                        help="print frequency (default: 10)")
    parser.add_argument("--resume", default="", type=str, metavar="PATH",
                        help="path to latest checkpoint (default: none)")
    parser.add_argument("-e", "--evaluate", dest="evaluate", action="store_true",
                        help="evaluate model on validation set")
    parser.add_argument("--pretrained", dest="pretrained", action="store_true",
                        help="use pre-trained model (torchvision downloads the weights)")
    parser.add_argument("--prof", default=-1, type=int,
                        help="profile iterations N to N+10 (cudaProfilerStart/Stop and NVTX "
                             "ranges on CUDA, for nsys --capture-range=cudaProfilerApi), "
                             "then exit")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--local_rank", "--local-rank", default=int(os.getenv("LOCAL_RANK", 0)),
                        type=int)
    parser.add_argument("--sync_bn", action="store_true", help="enabling synced BN (CUDA only).")

    parser.add_argument("--opt-level", type=str, default="O1", choices=("O0", "O1", "O2", "O3"))
    parser.add_argument("--keep-batchnorm-fp32", type=str, default=None)
    parser.add_argument("--loss-scale", type=str, default=None,
                        help='a number (static loss scale) or "dynamic"')
    parser.add_argument("--channels-last", action="store_true")

    # mixedprec additions.
    parser.add_argument("--bf16", action="store_true",
                        help="bfloat16 instead of float16 (cast_model_type=torch.bfloat16)")
    parser.add_argument("--fused-sgd", action="store_true",
                        help="mixedprec.FusedSGD (fp32 masters in the optimizer, no host sync "
                             "per step) instead of torch.optim.SGD")
    parser.add_argument("--ddp", choices=("mixedprec", "torch"), default="mixedprec",
                        help="mixedprec.parallel.DistributedDataParallel (Apex's arguments, "
                             "delay_allreduce=True as in Apex's recipe) or torch's")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    parser.add_argument("--synthetic-size", default=12800, type=int, metavar="N",
                        help="synthetic training images (validation: a fifth as many)")
    parser.add_argument("--image-size", default=224, type=int, metavar="PX",
                        help="crop size (default: 224; validation resizes to 8/7 of it)")
    parser.add_argument("--num-classes", default=1000, type=int,
                        help="classes of synthetic data (default: 1000)")
    parser.add_argument("--num-batches", default=0, type=int, metavar="N",
                        help="stop each training and validation epoch after N batches (0: all)")
    parser.add_argument("--checkpoint-dir", default=".", metavar="DIR",
                        help="where checkpoint.pth.tar and model_best.pth.tar go")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    parsed = parser.parse_args()
    if parsed.loss_scale not in (None, "dynamic"):
        try:
            float(parsed.loss_scale)
        except ValueError:
            parser.error(f'--loss-scale must be a number or "dynamic", got {parsed.loss_scale!r}')
    if parsed.keep_batchnorm_fp32 not in (None, "True", "False"):
        parser.error("--keep-batchnorm-fp32 must be True or False")
    return parsed


def main():
    global best_prec1, args

    args = parse()
    print("opt_level = {}".format(args.opt_level))
    print("keep_batchnorm_fp32 = {}".format(args.keep_batchnorm_fp32),
          type(args.keep_batchnorm_fp32))
    print("loss_scale = {}".format(args.loss_scale), type(args.loss_scale))
    print("bf16 = {}".format(args.bf16))

    use_cuda = torch.cuda.is_available() and not args.cpu
    if use_cuda:
        print("\nCUDNN VERSION: {}\n".format(torch.backends.cudnn.version()))
    cudnn.benchmark = True
    if args.deterministic:
        cudnn.benchmark = False
        cudnn.deterministic = True
        torch.manual_seed(args.local_rank)
        torch.set_printoptions(precision=10)

    args.distributed = False
    if "WORLD_SIZE" in os.environ:
        args.distributed = int(os.environ["WORLD_SIZE"]) > 1

    args.gpu = 0
    args.world_size = 1
    args.rank = 0
    if args.distributed:
        args.gpu = args.local_rank
        if use_cuda:
            torch.cuda.set_device(args.gpu)
        # NCCL between GPUs, gloo between CPU processes.
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", init_method="env://")
        args.world_size = dist.get_world_size()
        args.rank = dist.get_rank()
    args.device = torch.device("cuda", args.gpu) if use_cuda else torch.device("cpu")
    if args.sync_bn and args.distributed and not use_cuda:
        raise SystemExit("--sync_bn needs CUDA: torch's SyncBatchNorm does not run on the CPU")

    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format

    # create model
    if args.pretrained:
        print("=> using pre-trained model '{}'".format(args.arch))
        model = models.get_model(args.arch, weights="DEFAULT")
    else:
        print("=> creating model '{}'".format(args.arch))
        num_classes = {} if args.data else {"num_classes": args.num_classes}
        model = models.get_model(args.arch, **num_classes)

    if args.sync_bn:
        print("using synced BN")
        model = convert_syncbn_model(model)

    model = model.to(args.device).to(memory_format=memory_format)

    # Scale learning rate based on global batch size
    args.lr = args.lr * float(args.batch_size * args.world_size) / 256.0
    if args.fused_sgd:
        optimizer = mixedprec.FusedSGD(model.parameters(), args.lr, momentum=args.momentum,
                                       weight_decay=args.weight_decay)
    else:
        optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum,
                                    weight_decay=args.weight_decay)

    # Initialize Amp. Amp accepts either values or strings for the optional override
    # arguments, for convenient interoperation with argparse.
    model, optimizer = amp.initialize(model, optimizer,
                                      opt_level=args.opt_level,
                                      keep_batchnorm_fp32=args.keep_batchnorm_fp32,
                                      loss_scale=args.loss_scale,
                                      cast_model_type=torch.bfloat16 if args.bf16 else None)
    model_without_ddp = model

    # For distributed training, wrap the model with DistributedDataParallel. This must be
    # done AFTER the call to amp.initialize: amp.initialize changes the types of the
    # model's parameters, and DDP registers hooks on them.
    if args.distributed:
        device_ids = [args.gpu] if use_cuda else None
        if args.ddp == "mixedprec":
            # delay_allreduce delays all communication to the end of the backward pass.
            model = DDP(model, delay_allreduce=True, device_ids=device_ids)
        else:
            model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    # define loss function (criterion)
    criterion = nn.CrossEntropyLoss().to(args.device)

    # Optionally resume from a checkpoint
    if args.resume:
        # Use a local scope to avoid dangling references
        def resume():
            global best_prec1
            if os.path.isfile(args.resume):
                print("=> loading checkpoint '{}'".format(args.resume))
                checkpoint = torch.load(args.resume, map_location=args.device)
                args.start_epoch = checkpoint["epoch"]
                best_prec1 = checkpoint["best_prec1"]
                model_without_ddp.load_state_dict(checkpoint["state_dict"])
                optimizer.load_state_dict(checkpoint["optimizer"])
                if "amp" in checkpoint:  # loss scale and (O2) master weights
                    amp.load_state_dict(checkpoint["amp"])
                print("=> loaded checkpoint '{}' (epoch {})".format(args.resume,
                                                                    checkpoint["epoch"]))
            else:
                print("=> no checkpoint found at '{}'".format(args.resume))
        resume()

    # Data loading code
    if args.arch == "inception_v3":
        raise RuntimeError("Currently, inception_v3 is not supported by this example.")
    crop_size = args.image_size
    val_size = round(crop_size * 256 / 224)

    if args.data:
        traindir = os.path.join(args.data, "train")
        valdir = os.path.join(args.data, "val")
        train_dataset = datasets.ImageFolder(traindir, transforms.Compose([
            transforms.RandomResizedCrop(crop_size),
            transforms.RandomHorizontalFlip(),
            # transforms.ToTensor(), Too slow
            # normalize,
        ]))
        val_dataset = datasets.ImageFolder(valdir, transforms.Compose([
            transforms.Resize(val_size),
            transforms.CenterCrop(crop_size),
        ]))
    else:
        print("=> synthetic data: {} training and {} validation images of 3x{}x{}".format(
            args.synthetic_size, max(1, args.synthetic_size // 5), crop_size, crop_size))
        train_dataset = SyntheticImageNet(args.synthetic_size, crop_size, args.num_classes, 0)
        val_dataset = SyntheticImageNet(max(1, args.synthetic_size // 5), crop_size,
                                        args.num_classes, 1)

    train_sampler = None
    val_sampler = None
    if args.distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
        val_sampler = torch.utils.data.distributed.DistributedSampler(val_dataset,
                                                                      shuffle=False)

    def collate_fn(b):
        return fast_collate(b, memory_format)

    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=(train_sampler is None),
        num_workers=args.workers, pin_memory=use_cuda, sampler=train_sampler,
        collate_fn=collate_fn, persistent_workers=args.workers > 0)

    val_loader = torch.utils.data.DataLoader(
        val_dataset, batch_size=args.batch_size, shuffle=False,
        num_workers=args.workers, pin_memory=use_cuda, sampler=val_sampler,
        collate_fn=collate_fn, persistent_workers=args.workers > 0)

    if args.evaluate:
        validate(val_loader, model, criterion)
        del model  # (see cleanup)
        cleanup()
        return

    for epoch in range(args.start_epoch, args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)

        # train for one epoch
        train(train_loader, model, criterion, optimizer, epoch)

        # evaluate on validation set
        prec1 = validate(val_loader, model, criterion)

        # remember best prec@1 and save checkpoint
        if args.rank == 0:
            is_best = prec1 > best_prec1
            best_prec1 = max(prec1, best_prec1)
            save_checkpoint({
                "epoch": epoch + 1,
                "arch": args.arch,
                "opt_level": args.opt_level,
                "state_dict": model_without_ddp.state_dict(),
                "best_prec1": best_prec1,
                "optimizer": optimizer.state_dict(),
                "amp": amp.state_dict(),
            }, is_best)
    del model  # (see cleanup)
    cleanup()


def cleanup():
    """Leaves the process group, after main() dropped the DDP model: DDP's reducer holds
    the group, and a gloo group destroyed by it later, at main()'s exit, can deadlock
    against gloo's worker thread (seen with torch 2.11 on CPU). gc.collect() frees the
    reducer's reference cycles now."""
    if args.distributed:
        gc.collect()
        dist.barrier()  # leave together: a rank exiting early can abort gloo in its peer
        dist.destroy_process_group()


class data_prefetcher:
    """Moves the next batch to the device and normalises it while the current one
    trains (on a side stream on CUDA, as Apex's recipe did)."""

    def __init__(self, loader, device):
        self.loader = iter(loader)
        self.device = device
        self.stream = torch.cuda.Stream() if device.type == "cuda" else None
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
        # With Amp, it isn't necessary to manually convert data to half.
        self.preload()

    def preload(self):
        try:
            self.next_input, self.next_target = next(self.loader)
        except StopIteration:
            self.next_input = None
            self.next_target = None
            return
        if self.stream is None:
            self.next_input = self.next_input.float().sub_(self.mean).div_(self.std)
            return
        with torch.cuda.stream(self.stream):
            self.next_input = self.next_input.to(self.device, non_blocking=True)
            self.next_target = self.next_target.to(self.device, non_blocking=True)
            self.next_input = self.next_input.float()
            self.next_input = self.next_input.sub_(self.mean).div_(self.std)

    def next(self):
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
        input = self.next_input
        target = self.next_target
        if self.stream is not None:
            if input is not None:
                input.record_stream(torch.cuda.current_stream())
            if target is not None:
                target.record_stream(torch.cuda.current_stream())
        self.preload()
        return input, target


def nvtx_push(name):
    if args.prof >= 0 and args.device.type == "cuda":
        torch.cuda.nvtx.range_push(name)


def nvtx_pop():
    if args.prof >= 0 and args.device.type == "cuda":
        torch.cuda.nvtx.range_pop()


def synchronize():
    if args.device.type == "cuda":
        torch.cuda.synchronize()


def epoch_length(loader):
    return min(len(loader), args.num_batches) if args.num_batches > 0 else len(loader)


def progress(total, desc):
    return tqdm(total=total, desc=desc, unit="batch", dynamic_ncols=True, leave=False,
                disable=args.no_progress or args.rank != 0)


def log(bar, line):
    if args.rank != 0:
        return
    if bar.disable:
        print(line, flush=True)
    else:
        bar.write(line)


def train(train_loader, model, criterion, optimizer, epoch):
    batch_time = AverageMeter()
    losses = AverageMeter()
    top1 = AverageMeter()
    top5 = AverageMeter()

    # switch to train mode
    model.train()
    len_epoch = epoch_length(train_loader)
    bar = progress(len_epoch, "Epoch {}".format(epoch))
    synchronize()
    end = time.time()
    epoch_start = end

    prefetcher = data_prefetcher(train_loader, args.device)
    input, target = prefetcher.next()
    i = 0
    while input is not None and i < len_epoch:
        i += 1
        if args.prof >= 0 and i == args.prof:
            print("Profiling begun at iteration {}".format(i))
            if args.device.type == "cuda":
                torch.cuda.cudart().cudaProfilerStart()

        nvtx_push("Body of iteration {}".format(i))

        adjust_learning_rate(optimizer, epoch, i, len_epoch)

        # compute output
        nvtx_push("forward")
        output = model(input)
        nvtx_pop()
        # O1's autocast ends with the forward: take the loss in fp32, as Apex's O1
        # (which patched cross_entropy to run in fp32) did.
        loss = criterion(output.float(), target)

        # compute gradient and do SGD step
        optimizer.zero_grad()

        nvtx_push("backward")
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        nvtx_pop()

        nvtx_push("optimizer.step()")
        optimizer.step()
        nvtx_pop()

        if i % args.print_freq == 0 or i == len_epoch:
            # Every print_freq iterations, check the loss, accuracy, and speed.
            # For best performance, it doesn't make sense to print these metrics every
            # iteration, since they incur an allreduce and some host<->device syncs.
            n = i % args.print_freq or args.print_freq

            # to_python_float incurs a host<->device sync
            update_meters(output, target, loss, losses, top1, top5)

            synchronize()
            batch_time.update((time.time() - end) / n)
            end = time.time()

            log(bar, "Epoch: [{0}][{1}/{2}]\t"
                     "Time {batch_time.val:.3f} ({batch_time.avg:.3f})\t"
                     "Speed {3:.3f} ({4:.3f})\t"
                     "Loss {loss.val:.10f} ({loss.avg:.4f})\t"
                     "Prec@1 {top1.val:.3f} ({top1.avg:.3f})\t"
                     "Prec@5 {top5.val:.3f} ({top5.avg:.3f})".format(
                         epoch, i, len_epoch,
                         args.world_size * args.batch_size / batch_time.val,
                         args.world_size * args.batch_size / batch_time.avg,
                         batch_time=batch_time,
                         loss=losses, top1=top1, top5=top5))
            bar.set_postfix(loss="{:.4f}".format(losses.val), refresh=False)
        bar.update(1)
        nvtx_push("prefetcher.next()")
        input, target = prefetcher.next()
        nvtx_pop()

        # Pop range "Body of iteration {}".format(i)
        nvtx_pop()

        if args.prof >= 0 and i == args.prof + 10:
            print("Profiling ended at iteration {}".format(i))
            if args.device.type == "cuda":
                torch.cuda.cudart().cudaProfilerStop()
            bar.close()
            cleanup()
            raise SystemExit(0)
    bar.close()
    synchronize()
    elapsed = time.time() - epoch_start
    if args.rank == 0 and i:
        print("Epoch: [{0}] {1} iterations in {2:.1f}s, {3:.1f} images/s, loss {4:.4f}".format(
            epoch, i, elapsed, args.world_size * args.batch_size * i / elapsed, losses.avg),
            flush=True)


def validate(val_loader, model, criterion):
    batch_time = AverageMeter()
    losses = AverageMeter()
    top1 = AverageMeter()
    top5 = AverageMeter()

    # switch to evaluate mode
    model.eval()
    len_epoch = epoch_length(val_loader)
    bar = progress(len_epoch, "Test")

    end = time.time()

    prefetcher = data_prefetcher(val_loader, args.device)
    input, target = prefetcher.next()
    i = 0
    while input is not None and i < len_epoch:
        i += 1

        # compute output
        with torch.no_grad():
            output = model(input)
            loss = criterion(output.float(), target)

        # measure accuracy and record loss
        update_meters(output, target, loss, losses, top1, top5)

        # measure elapsed time
        batch_time.update(time.time() - end)
        end = time.time()

        # TODO:  Change timings to mirror train().
        if i % args.print_freq == 0:
            log(bar, "Test: [{0}/{1}]\t"
                     "Time {batch_time.val:.3f} ({batch_time.avg:.3f})\t"
                     "Speed {2:.3f} ({3:.3f})\t"
                     "Loss {loss.val:.4f} ({loss.avg:.4f})\t"
                     "Prec@1 {top1.val:.3f} ({top1.avg:.3f})\t"
                     "Prec@5 {top5.val:.3f} ({top5.avg:.3f})".format(
                         i, len_epoch,
                         args.world_size * args.batch_size / batch_time.val,
                         args.world_size * args.batch_size / batch_time.avg,
                         batch_time=batch_time, loss=losses,
                         top1=top1, top5=top5))
        bar.update(1)

        input, target = prefetcher.next()
    bar.close()

    if args.rank == 0:
        print(" * Prec@1 {top1.avg:.3f} Prec@5 {top5.avg:.3f}".format(top1=top1, top5=top5),
              flush=True)

    return top1.avg


def save_checkpoint(state, is_best, filename="checkpoint.pth.tar"):
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    path = os.path.join(args.checkpoint_dir, filename)
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(args.checkpoint_dir, "model_best.pth.tar"))


class AverageMeter:
    """Computes and stores the average and current value"""

    def __init__(self):
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def adjust_learning_rate(optimizer, epoch, step, len_epoch):
    """LR schedule that should yield 76% converged accuracy with batch size 256"""
    factor = epoch // 30

    if epoch >= 80:
        factor = factor + 1

    lr = args.lr * (0.1 ** factor)

    # Warmup
    if epoch < 5:
        lr = lr * float(1 + step + epoch * len_epoch) / (5.0 * len_epoch)

    for param_group in optimizer.param_groups:
        param_group["lr"] = lr


def accuracy(output, target, topk=(1,)):
    """Computes the precision@k for the specified values of k"""
    maxk = min(max(topk), output.size(1))
    batch_size = target.size(0)

    _, pred = output.topk(maxk, 1, True, True)
    pred = pred.t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))

    res = []
    for k in topk:
        correct_k = correct[:min(k, maxk)].reshape(-1).float().sum(0, keepdim=True)
        res.append(correct_k.mul_(100.0 / batch_size))
    return res


def update_meters(output, target, loss, losses, top1, top5):
    """Records the batch's loss and top-1/top-5 accuracy, averaged over the processes
    when distributed."""
    prec1, prec5 = accuracy(output.data, target, topk=(1, 5))
    loss = loss.data
    if args.distributed:
        loss, prec1, prec5 = reduce_tensor(loss), reduce_tensor(prec1), reduce_tensor(prec5)
    n = output.size(0)
    losses.update(to_python_float(loss), n)
    top1.update(to_python_float(prec1), n)
    top5.update(to_python_float(prec5), n)


def reduce_tensor(tensor):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    rt /= args.world_size
    return rt


if __name__ == "__main__":
    main()
