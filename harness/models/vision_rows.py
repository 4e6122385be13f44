"""Rows on torchvision (ResNet, MobileNetV3, ViT) and timm (ConvNeXt,
EfficientNet): image classifiers built from their constructors with random
weights, float64 (one ResNet in float32, channels_last, under bfloat16
autocast, as vision models are trained on GPUs), in train mode (BatchNorm
statistics, dropout and stochastic depth on), trained with SGD (lr 0.05, momentum 0.9, weight decay
1e-4) on batches of 4 random 32x32 images (16x16 for ViT) with random labels
of 10 classes, drawn from the global RNG at each step; cross-entropy loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.models.registry import row
from harness.models.row import Setup

BATCH, CLASSES = 4, 10
F64 = torch.float64


def _classifier(
    model: torch.nn.Module,
    device: torch.device,
    size: int = 32,
    dtype: torch.dtype = F64,
    memory_format: torch.memory_format = torch.contiguous_format,
    autocast: torch.dtype | None = None,
) -> Setup:
    model = model.to(device=device, dtype=dtype, memory_format=memory_format).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)

    def forward() -> torch.Tensor:
        images = torch.randn(BATCH, 3, size, size, device=device, dtype=dtype)
        labels = torch.randint(CLASSES, (BATCH,), device=device)
        return F.cross_entropy(model(images.contiguous(memory_format=memory_format)), labels)

    def loss() -> torch.Tensor:
        if autocast is None:
            return forward()
        with torch.autocast(device.type, dtype=autocast):
            return forward()

    return Setup(model, opt, loss)


@row(
    "resnet",
    "torchvision",
    "torchvision ResNet(BasicBlock, [1, 1, 1, 1]) (4.9M parameters), BatchNorm, float64; 3 steps",
)
def resnet(device: torch.device) -> Setup:
    from torchvision.models.resnet import BasicBlock, ResNet

    return _classifier(ResNet(BasicBlock, [1, 1, 1, 1], num_classes=CLASSES), device)


@row(
    "resnet_grad_accum",
    "torchvision",
    "ResNet as in resnet, 3 micro-batches per step (gradient accumulation; BatchNorm's running "
    "statistics move each forward), .grad freed between steps: the first backward of a step creates "
    "it, the next two add into it; 2 steps",
    steps=2,
    micro_batches=3,
)
def resnet_grad_accum(device: torch.device) -> Setup:
    from torchvision.models.resnet import BasicBlock, ResNet

    return _classifier(ResNet(BasicBlock, [1, 1, 1, 1], num_classes=CLASSES), device)


@row(
    "resnet_amp_channels_last",
    "torchvision",
    "ResNet as in resnet with float32 parameters in channels_last, images in channels_last, the "
    "forward under torch.autocast(dtype=bfloat16): the convolution gradients' strides and the casts; 1 step",
    dtype=torch.float32,
    compute_dtype=torch.bfloat16,
    steps=1,
)
def resnet_amp_channels_last(device: torch.device) -> Setup:
    # One step: inductor rounds bfloat16 otherwise than eager (fused kernels
    # keep float32 between ops), 1.5% of the largest gradient of BatchNorm's
    # bias at the first step on the CPU (torch 2.13); through BatchNorm of 4
    # images that grows to 90% at the second step, for torch's compiled
    # autograd with inductor alike: not comparable by any tolerance
    from torchvision.models.resnet import BasicBlock, ResNet

    model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=CLASSES)
    return _classifier(
        model, device, dtype=torch.float32, memory_format=torch.channels_last, autocast=torch.bfloat16
    )


@row(
    "mobilenet_v3",
    "torchvision",
    "torchvision mobilenet_v3_small(width_mult=0.25): depthwise convs, squeeze-excitation, "
    "Hardswish, dropout 0.2, float64; 3 steps",
)
def mobilenet_v3(device: torch.device) -> Setup:
    from torchvision.models import mobilenet_v3_small

    return _classifier(mobilenet_v3_small(num_classes=CLASSES, width_mult=0.25), device)


@row(
    "tv_vit",
    "torchvision",
    "torchvision VisionTransformer, 16x16 images in 4x4 patches, 2 layers, dropout and "
    "attention dropout 0.1, float64; 3 steps",
)
def tv_vit(device: torch.device) -> Setup:
    from torchvision.models.vision_transformer import VisionTransformer

    model = VisionTransformer(
        image_size=16,
        patch_size=4,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        dropout=0.1,
        attention_dropout=0.1,
        num_classes=CLASSES,
    )
    return _classifier(model, device, size=16)


@row(
    "timm_convnext",
    "timm",
    "timm test_convnext (depthwise 7x7 convs, LayerNorm, layer scale), drop_rate 0.1, "
    "drop_path_rate 0.1, float64; 3 steps",
)
def timm_convnext(device: torch.device) -> Setup:
    import timm

    model = timm.create_model("test_convnext", pretrained=False, num_classes=CLASSES, drop_rate=0.1, drop_path_rate=0.1)
    return _classifier(model, device)


@row(
    "timm_efficientnet",
    "timm",
    "timm test_efficientnet (MBConv, squeeze-excitation, SiLU, BatchNorm), drop_rate 0.1, "
    "drop_path_rate 0.1, float64; 3 steps",
)
def timm_efficientnet(device: torch.device) -> Setup:
    import timm

    model = timm.create_model(
        "test_efficientnet", pretrained=False, num_classes=CLASSES, drop_rate=0.1, drop_path_rate=0.1
    )
    return _classifier(model, device)
