import torch

from engine.kernels import linear


def test_autotuned_linear_computes_the_same_product():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.Linear(96, 32, bias=False))
    xs = [torch.randn(1, n, 48) for n in (1, 2, 3, 5, 16, 40)]
    expected = [model(x) for x in xs]
    linear.autotune_linears(model)
    for layer in model:  # whatever was chosen, force the transposed form on too
        table = linear._tuned[(layer.in_features, layer.out_features, torch.float32,
                               torch.device("cpu"))]
        layer.forward = linear._make_forward(layer, [True] * len(table))
    for x, want in zip(xs, expected):
        torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)


def test_tuning_is_cached_per_shape():
    w = torch.randn(24, 12)
    first = linear._tune(w)
    assert linear._tune(torch.randn(24, 12)) is first
    assert len(first) == linear.MAX_ROWS + 1 and first[0] is False
