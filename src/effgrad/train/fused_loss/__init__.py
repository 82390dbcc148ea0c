"""Cross-entropy over a large vocabulary without ever holding the ``[rows, vocabulary]`` logits.

A language model's last layer projects each position's hidden state ``h``
(``d`` numbers) onto the vocabulary (``V`` numbers, tens of thousands), and the
loss is a softmax cross-entropy over those logits. Computed plainly, the
logits of a batch (``rows = batch * T``) are one ``[rows, V]`` float32 tensor
(``4 * rows * V`` bytes: GiBs at a real vocabulary) and backprop holds about
two more of its size. Fused, in chunks of rows (Cut Cross-Entropy, Wijmans et
al. 2025; Liger's fused linear cross-entropy)::

    forward, per chunk c of rows and     z = h_c @ W_j (+ b_j) (soft-capped: cap * tanh(z / cap))
    j of 4,096 classes:                  running max m_c and sum s_c of exp(z - m_c): the logsumexp
                                         a_c: the running sum of exp(z - m_c) @ W_j^T, rescaled as m_c grows
                                         keep lse_c = m_c + log s_c (one number per row) and
                                         g_c = a_c / s_c - W[label_c] (d loss_c / d h_c: [rows, d]); drop z
    backward:                            dh_c = dloss_c * g_c
    W's gradient, per chunk j of         z recomputed;  dz = (exp(z_cj - lse_c) - onehot(label)) * dloss_c
    4,096 classes and c of rows:         dW_j += h_c^T @ dz;  db_j += sum(dz); each dW_j written in place

Only one chunk's logits (16 MiB of float32 by default) exist at a time (with
rank metrics the forward chunks hold all classes of fewer rows: a rank needs
the label's logit before the others are counted), and
the kernel's gradient is summed per class chunk in a small buffer (summing
whole kernel-sized gradients over row chunks would keep three of them
alive). The loss and every gradient equal the plain computation's (the
chunks run in float32 whatever the compute dtype). Four matmuls of the
head's size, where the plain loss does three: the logits are made twice.

Because the hidden states' gradient is made in the forward pass (an online
softmax, as flash attention's), the kernel's gradient needs nothing from
backprop but ``dloss`` (a number per row), so it can wait: inside
:func:`kernel_gradients_later` (the train step's backprop) it is made after
the backward pass of the whole model under the head, instead of being held
through it (a ``[d, V]`` buffer, where that backward pass peaks).

Trap:
    The saving is in the loss, not the model: anything else that reads the
    logits needs them. Compiled accuracy and top-k metrics (``attach``) are
    computed from the chunks (each position's rank among the classes);
    with any other compiled metric the step does not fuse and warns, rather
    than report a metric computed on something else.
"""

from effgrad.train.fused_loss.deferred import kernel_gradients_later
from effgrad.train.fused_loss.head import Head, find_head
from effgrad.train.fused_loss.kernel import fused_sparse_cross_entropy
from effgrad.train.fused_loss.policy import decide, readers_of_logits

__all__ = ["fused_sparse_cross_entropy", "Head", "find_head", "decide", "readers_of_logits", "kernel_gradients_later"]
