"""BackPACK's "Saving memory in convolutions" example, run on leanprop's BackPACK facade.

Unchanged apart from: the imports (``leanprop.compat.backpack`` instead of ``backpack``),
random data instead of an MNIST download, and leanprop's exact tensor-memory tracker instead of
``memory_profiler`` (whose RSS sampling is unreliable, see ``leanprop/memory.py``).

Run: python examples/backpack_save_memory.py
"""

import time

import torch
from torch.nn import (
    Conv2d,
    CrossEntropyLoss,
    Flatten,
    Linear,
    MaxPool2d,
    ReLU,
    Sequential,
)

from leanprop import track_memory
from leanprop.compat.backpack import backpack, extend, extensions, weight_jac_t_save_memory


def load_one_batch_mnist(batch_size):
    """Random stand-in for one MNIST batch: inputs [N, 1, 28, 28], labels [N]."""
    return torch.randn(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))


def setup(device):
    """Load MNIST batch, create extended CNN and loss function. Load to device."""
    X, y = load_one_batch_mnist(batch_size=64)
    X, y = X.to(device), y.to(device)

    model = extend(
        Sequential(
            Conv2d(1, 128, 3, padding=1),
            ReLU(),
            MaxPool2d(3, stride=2),
            Conv2d(128, 256, 3, padding=1),
            ReLU(),
            MaxPool2d(3, padding=1, stride=2),
            Conv2d(256, 64, 3, padding=1),
            ReLU(),
            MaxPool2d(3, stride=2),
            Conv2d(64, 32, 3, padding=1),
            ReLU(),
            MaxPool2d(3, stride=2),
            Flatten(),
            Linear(32, 10),
        ).to(device)
    )

    lossfunc = extend(CrossEntropyLoss().to(device))

    return X, y, model, lossfunc


def compute_individual_gradients(device, seed=0):
    """Compute individual gradients for the seeded problem specified in ``setup``."""
    torch.manual_seed(seed)

    X, y, model, lossfunc = setup(device)

    loss = lossfunc(model(X), y)

    with backpack(extensions.BatchGrad()):
        loss.backward()

    return {name: param.grad_batch for name, param in model.named_parameters()}


def compare_peakmem(device):
    """Print peak memory of different vector-Jacobian algorithms for convolution."""
    print(f"Device: {device}")

    for save_memory in True, False:
        with weight_jac_t_save_memory(save_memory=save_memory), track_memory(device) as mem:
            compute_individual_gradients(device)

        print(f"Save memory: {save_memory}\tPeak memory: {mem.peak_mib:.1f}")


def compare_runtime(device):
    """Print run time of different vector-Jacobian algorithms for convolution."""
    print(f"Device: {device}")

    for save_memory in True, False:
        with weight_jac_t_save_memory(save_memory=save_memory):
            start = time.time()

            compute_individual_gradients(device)

            if str(device) == "cuda":
                torch.cuda.synchronize()

            run_time = time.time() - start

        print(f"Save memory: {save_memory}\tRun time: {run_time:.3f}")


def check_same_results(device):
    with weight_jac_t_save_memory(save_memory=True):
        individual_gradients = compute_individual_gradients(device)

    with weight_jac_t_save_memory(save_memory=False):
        save_memory_individual_gradients = compute_individual_gradients(device)

    print(f"{'Parameter':<10}| Same individual gradients?")
    for param_name in individual_gradients:
        same = torch.allclose(
            individual_gradients[param_name],
            save_memory_individual_gradients[param_name],
            atol=1e-7,
        )
        msg = f"{param_name:<10}| {same}"

        if same:
            print(msg)
        else:
            raise ValueError(msg)


if __name__ == "__main__":
    compare_peakmem(torch.device("cpu"))
    compare_runtime(torch.device("cpu"))
    if torch.cuda.is_available():
        compare_runtime(torch.device("cuda"))
    check_same_results(torch.device("cpu"))
