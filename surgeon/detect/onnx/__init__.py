"""Find attention in an ONNX graph by walking it.

Initializer names after export carry no meaning (``onnx::MatMul_123``, ``val_55``), so the
structure is all there is. Like ONNX Runtime's transformer optimizer, the walk starts from each
attention core and follows the data back to the projections, but it accepts any chain of the
reshaping, scaling, masking, rotary and bias ops that exporters put in between instead of a fixed
pattern:

* core: a ``Softmax`` whose input comes from a Q·Kᵀ product; ``com.microsoft`` ``Attention``,
  ``MultiHeadAttention`` or ``GroupQueryAttention``; the standard ``Attention`` op (opset 23).
* Q and K are the two operands of the Q·Kᵀ product, V the second operand of the
  probabilities·V product after the Softmax (fused ops name them as inputs).
* each of them is followed back to the first ``MatMul``/``Gemm`` with a constant weight. On the
  way from that projection to the core, a ``Split``/``Slice`` of the feature axis, or a ``Gather``
  (``Split``, one-index ``Slice``) of an unflattened (3, E) or (3, H, D) axis (timm's fused qkv),
  selects the columns that belong to the role (fused QKV), an
  ``Add`` of a 1-D initializer is the bias, and the ``Reshape`` that splits the feature axis
  gives (heads, head_dim).

Blocks are numbered in graph order; their module path comes from the exporter's scopes (the
legacy exporter's node names ``/encoder/layer.0/attention/self/Softmax``, the dynamo exporter's
``pkg.torch.onnx.name_scopes`` / ``namespace`` metadata), which also gives stacks and layer numbers;
without scopes, the core nodes' name prefixes group them. A module called several times with the
same weights (ALBERT) is one block. Weights in ``Constant`` nodes count as initializers.
"""

from .blocks import find_attention

__all__ = ["find_attention"]
