"""Privacy accounting for DP-SGD (``build_train_step(..., per_example_clip=C, noise_multiplier=sigma)``).

Each step of DP-SGD on a batch sampled from ``num_examples`` examples (rate
``q = batch_size / num_examples``) is a sampled Gaussian mechanism; ``steps``
of them compose. The ``dp-accounting`` package (Google's DP library) turns
that into the ``epsilon`` of an ``(epsilon, delta)`` guarantee::

    event = SelfComposed(PoissonSampled(q, Gaussian(sigma)), steps)
    epsilon = Accountant().compose(event).get_epsilon(delta)

with the RDP accountant (Mironov 2017; Abadi et al.'s moments accountant) or
the PLD accountant (privacy loss distributions: tighter, slower).

Example:
    >>> eps = effgrad.privacy.epsilon(steps=1000, batch_size=256, num_examples=60000,
    ...                               noise_multiplier=1.1, delta=1e-5)
    >>> 0 < eps < 2
    True

Trap:
    The guarantee assumes each batch is a Poisson sample of the dataset
    (each example in with probability ``q``). A shuffled pass in fixed-size
    batches is the usual approximation (TF Privacy and Opacus report it the
    same way); say which you used when you quote the number. ``delta`` should
    be well below ``1 / num_examples``.
"""

from __future__ import annotations

import keras

__all__ = ["epsilon", "EpsilonCallback"]

_ACCOUNTANTS = ("rdp", "pld")


def _positive(value, name: str, *, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        raise ValueError(f"{name} must be a positive {'int' if integer else 'number'}, got {value!r}.")


def epsilon(
    *,
    steps: int,
    batch_size: int,
    num_examples: int,
    noise_multiplier: float,
    delta: float,
    accountant: str = "rdp",
) -> float:
    """The ``epsilon`` of ``(epsilon, delta)``-DP after ``steps`` DP-SGD steps.

    Args:
        steps: Optimizer updates taken (``model.optimizer.iterations``).
        batch_size: Examples per step (the logical batch, all micro-batches and replicas).
        num_examples: Examples in the training set.
        noise_multiplier: ``sigma`` of ``build_train_step(noise_multiplier=...)``.
        delta: The ``delta`` of the guarantee, e.g. ``1e-5``.
        accountant: ``"rdp"`` (Renyi DP) or ``"pld"`` (privacy loss distributions).

    Returns:
        ``epsilon`` (``inf`` with ``noise_multiplier=0``: clipping alone gives no privacy).
    """
    _positive(steps, "steps", integer=True)
    _positive(batch_size, "batch_size", integer=True)
    _positive(num_examples, "num_examples", integer=True)
    if batch_size > num_examples:
        raise ValueError(f"batch_size ({batch_size}) cannot exceed num_examples ({num_examples}).")
    if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, (int, float)) or noise_multiplier < 0:
        raise ValueError(f"noise_multiplier must be a number >= 0, got {noise_multiplier!r}.")
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}.")
    if accountant not in _ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {_ACCOUNTANTS}, got {accountant!r}.")
    if noise_multiplier == 0:
        return float("inf")
    import dp_accounting

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(batch_size / num_examples, dp_accounting.GaussianDpEvent(noise_multiplier)),
        steps,
    )
    if accountant == "rdp":
        # From 1.5: dp-accounting does not converge (and warns) below 1.4 at common settings.
        orders = [1 + x / 10.0 for x in range(5, 100)] + list(range(11, 64)) + [128, 256, 512]
        ledger = dp_accounting.rdp.RdpAccountant(orders)
    else:
        ledger = dp_accounting.pld.PLDAccountant()
    ledger.compose(event)
    return float(ledger.get_epsilon(delta))


class EpsilonCallback(keras.callbacks.Callback):
    """Puts ``epsilon`` (spent so far) into ``fit``'s logs at the end of every epoch.

    Example:
        >>> model.fit(x, y, batch_size=256, epochs=3,                     # doctest: +SKIP
        ...           callbacks=[effgrad.privacy.EpsilonCallback(num_examples=len(x), batch_size=256,
        ...                                                       noise_multiplier=1.1, delta=1e-5)])

    Args:
        num_examples: Examples in the training set.
        batch_size: Examples per step.
        noise_multiplier: The step's ``noise_multiplier``.
        delta: The ``delta`` of the guarantee.
        accountant: ``"rdp"`` or ``"pld"``.

    The steps counted are the optimizer's applied updates (a step skipped for
    non-finite gradients released nothing).
    """

    def __init__(self, *, num_examples: int, batch_size: int, noise_multiplier: float, delta: float, accountant="rdp"):
        super().__init__()
        self.settings = {
            "num_examples": num_examples,
            "batch_size": batch_size,
            "noise_multiplier": noise_multiplier,
            "delta": delta,
            "accountant": accountant,
        }
        epsilon(steps=1, **self.settings)  # every bad setting is refused before training starts

    def on_epoch_end(self, epoch, logs=None):
        step = getattr(self.model, "effgrad_step", None)
        optimizer = step.optimizer if step is not None else self.model.optimizer
        steps = int(optimizer.iterations.numpy())
        if logs is not None and steps > 0:
            logs["epsilon"] = epsilon(steps=steps, **self.settings)
