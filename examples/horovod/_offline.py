"""Offline stand-ins for what Horovod's examples download or import besides Horovod.

The ported examples (this directory) run where torchvision is not installed
and nothing can be downloaded (the tests): a small model in place of
torchvision's models, and MNIST-shaped synthetic data that a small network
learns quickly (each digit class is a bright 7x7 square at its own place,
plus noise), so the examples' own accuracy checks still mean something.

    python _offline.py mxnet-data DIR      # DIR/mnist.zip, as mxnet_mnist.py downloads it
"""

from __future__ import annotations

import io
import os
import struct
import sys
import zipfile
from types import SimpleNamespace

import numpy as np

SAMPLES = int(os.environ.get("REDUCER_EXAMPLE_SAMPLES", "1024"))
# tensorflow2_keras_mnist.py's run length (Horovod's: 500 steps, 24 epochs).
STEPS = int(os.environ.get("REDUCER_EXAMPLE_STEPS", "500"))
EPOCHS = int(os.environ.get("REDUCER_EXAMPLE_EPOCHS", "24"))


def synthetic_mnist(samples: int = SAMPLES, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [N, 28, 28], labels uint8 [N]): a square per class, plus noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=samples).astype(np.uint8)
    images = rng.integers(0, 60, size=(samples, 28, 28)).astype(np.uint8)
    for index, label in enumerate(labels):
        row, col = 3 + 7 * (label // 4), 3 + 7 * (label % 4)
        images[index, row:row + 7, col:col + 7] = 255
    return images, labels


def load_mnist(seed: int = 0):
    """tf.keras.datasets.mnist.load_data()'s shape: ((x_train, y_train), (x_test, y_test))."""
    train = synthetic_mnist(SAMPLES, seed)
    test = synthetic_mnist(max(64, SAMPLES // 4), seed + 1000)
    return train, test


def _idx(array: np.ndarray) -> bytes:
    """The IDX file format of MNIST (big-endian dimensions, uint8 data)."""
    header = struct.pack(">I", 0x0800 | array.ndim) + b"".join(
        struct.pack(">I", d) for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist_zip(directory: str, samples: int = SAMPLES) -> str:
    """DIR/mnist.zip with the four IDX files mxnet_mnist.py extracts."""
    os.makedirs(directory, exist_ok=True)
    (train_x, train_y), (test_x, test_y) = (synthetic_mnist(samples, 0),
                                            synthetic_mnist(max(64, samples // 4), 1000))
    path = os.path.join(directory, "mnist.zip")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("train-images-idx3-ubyte", _idx(train_x))
        archive.writestr("train-labels-idx1-ubyte", _idx(train_y))
        archive.writestr("t10k-images-idx3-ubyte", _idx(test_x))
        archive.writestr("t10k-labels-idx1-ubyte", _idx(test_y))
    with open(path, "wb") as out:
        out.write(buffer.getvalue())
    return path


def _torch_stand_ins() -> tuple[SimpleNamespace, SimpleNamespace, SimpleNamespace]:
    import torch

    class TinyNet(torch.nn.Module):
        """A few thousand parameters with an ImageNet-shaped input and output."""

        def __init__(self, num_classes: int = 1000) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, kernel_size=7, stride=4)
            self.fc = torch.nn.Linear(8, num_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.conv(x))
            return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1))

    class MNIST(torch.utils.data.Dataset):
        """torchvision.datasets.MNIST's interface over synthetic_mnist."""

        def __init__(self, root: str, train: bool = True, download: bool = False,
                     transform=None) -> None:
            images, labels = synthetic_mnist(SAMPLES if train else max(64, SAMPLES // 4),
                                             0 if train else 1000)
            self.images = torch.from_numpy(images).float().div(255.0).unsqueeze(1)
            self.labels = torch.from_numpy(labels.astype(np.int64))
            self.images = (self.images - 0.1307) / 0.3081  # the example's Normalize

        def __len__(self) -> int:
            return len(self.labels)

        def __getitem__(self, index: int):
            return self.images[index], self.labels[index]

    def identity(*args, **kwargs):
        return lambda x: x
    models = SimpleNamespace(tinynet=TinyNet)
    datasets = SimpleNamespace(MNIST=MNIST)
    transforms = SimpleNamespace(Compose=identity, ToTensor=identity, Normalize=identity)
    return models, datasets, transforms


def __getattr__(name: str):
    if name in ("models", "datasets", "transforms"):
        models, datasets, transforms = _torch_stand_ins()
        return {"models": models, "datasets": datasets, "transforms": transforms}[name]
    raise AttributeError(name)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "mxnet-data":
        sys.exit("usage: python _offline.py mxnet-data DIR")
    print(write_mnist_zip(sys.argv[2]))
