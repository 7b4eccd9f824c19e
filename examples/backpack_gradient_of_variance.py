"""BackPACK's "Gradient of backpropagated quantities" example, run on leanprop's BackPACK facade.

Unchanged apart from the imports, random data instead of an MNIST download, and
``check_same_results`` raising (instead of only printing) when a comparison fails.

Run: python examples/backpack_gradient_of_variance.py
"""

import torch
from torch import nn

from leanprop.compat.backpack import backpack, extend
from leanprop.compat.backpack.extensions import Variance

torch.manual_seed(0)
DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def load_one_batch_mnist(batch_size):
    """Random stand-in for one MNIST batch: inputs [N, 1, 28, 28], labels [N]."""
    return torch.randn(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))


def total_variance_and_gradient_backpack(x, y, model, lossfunc):
    """Total variance of the individual gradients and its gradient, with the facade."""
    model.zero_grad()
    loss = lossfunc(model(x), y)
    with backpack(Variance()):
        loss.backward(retain_graph=True, create_graph=True)

    total_var = 0
    for p in model.parameters():
        total_var += torch.sum(p.variance)

    grad_of_var = torch.autograd.grad(total_var, model.parameters())

    return total_var, grad_of_var


def individual_gradients_pytorch(x, y, model, lossfunc):
    """[N, D] individual gradients by a loop over samples (create_graph=True)."""
    model.zero_grad()
    grads_vector_format = []
    for i in range(x.shape[0]):
        x_i = x[i, :].unsqueeze(0)
        y_i = y[i].unsqueeze(0) if len(y.shape) == 1 else y[i, :].unsqueeze(0)

        loss = lossfunc(model(x_i), y_i)

        grad_list_format = torch.autograd.grad(
            loss, model.parameters(), create_graph=True, retain_graph=True
        )
        grad_vector_format = torch.cat([g.view(-1) for g in grad_list_format])
        grads_vector_format.append(grad_vector_format.clone())

    return torch.stack(grads_vector_format)


def total_variance_and_gradient_pytorch(x, y, model, lossfunc):
    """Total variance of the individual gradients and its gradient, with the loop."""
    ind_grads = individual_gradients_pytorch(x, y, model, lossfunc)
    variance = torch.var(ind_grads, dim=0, unbiased=False)
    total_var = torch.sum(variance)

    grad_of_var = torch.autograd.grad(total_var, model.parameters())

    return total_var, grad_of_var


def check_same_results(x, y, model, lossfunc):
    """Compares the results between the PyTorch loop and the facade; raises on mismatch."""
    var_bp, grad_var_bp = total_variance_and_gradient_backpack(x, y, model, lossfunc)
    var_pt, grad_var_pt = total_variance_and_gradient_pytorch(x, y, model, lossfunc)
    for p in model.parameters():
        p.grad = None  # break the create_graph reference cycle

    same = torch.allclose(var_bp, var_pt, atol=1e-4, rtol=1e-4)
    print("Total variance is the same?")
    print("   ", same)
    assert same, (var_bp, var_pt)

    print("Variance of the total variance w.r.t. parameters is the same?")
    for (name, _), p_grad_var_bp, p_grad_var_pt in zip(
        model.named_parameters(), grad_var_bp, grad_var_pt, strict=True
    ):
        match = torch.allclose(p_grad_var_bp, p_grad_var_pt, atol=1e-4, rtol=1e-4)
        print(f"    {name:<20}: {match}")
        assert match, name


if __name__ == "__main__":
    N, D = 3, 2
    x = torch.randn(N, D).to(DEVICE)
    y = torch.randn(N, 1).to(DEVICE)
    model = extend(nn.Sequential(nn.Linear(D, 1, bias=False))).to(DEVICE)
    lossfunc = torch.nn.MSELoss(reduction="sum")
    check_same_results(x, y, model, lossfunc)

    x, y = load_one_batch_mnist(batch_size=32)
    x, y = x.to(DEVICE), y.to(DEVICE)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    model = extend(model).to(DEVICE)
    lossfunc = torch.nn.CrossEntropyLoss(reduction="sum")
    check_same_results(x, y, model, lossfunc)

    x, y = load_one_batch_mnist(batch_size=32)
    x, y = x.to(DEVICE), y.to(DEVICE)
    model = extend(
        torch.nn.Sequential(
            torch.nn.Conv2d(1, 5, 5, 1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2, 2),
            torch.nn.Flatten(),
            torch.nn.Linear(720, 10),
        )
    ).to(DEVICE)
    lossfunc = torch.nn.CrossEntropyLoss(reduction="sum")
    check_same_results(x, y, model, lossfunc)
