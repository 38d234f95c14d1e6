"""Find the attention blocks of an ``nn.Module`` in memory.

Three routes, from the most to the least settled:

* **names** -- a Hugging Face ``PreTrainedModel`` (anywhere in the module tree) is detected exactly as
  its checkpoint would be: :func:`surgeon.detect.by_name.detect` on its parameter names and
  ``config.to_dict()``. Its checkpoint names (transformers 5 renames some modules in memory, e.g.
  ViT's ``attention.attention.query`` is ``attention.q_proj``) key the random draws, so a model in
  memory gets the same weights as its saved checkpoint.
* **class** -- ``torch.nn.MultiheadAttention``: its layout is fixed by torch (``in_proj_weight``
  blocked [Q; K; V], or ``q/k/v_proj_weight`` when kdim/vdim differ).
* **forward** -- everything else (timm, custom modules naming their projections freely, fused layouts
  of any order): the module's own forward is run on a small probe input and surgeon watches which
  rows of which parameter reach the query, key and value that enter the attention product
  (``F.scaled_dot_product_attention``, or softmax(Q Kᵀ) V written with matmul/bmm/einsum).

How the forward is read: a ``TorchFunctionMode`` replaces the output of every projection-like op
(``F.linear``, ``addmm``, ``matmul`` whose weight operand is a view of a 2-D parameter) with a
*code* per output feature, and records the q/k/v handed to the attention product. Four forwards
with four codings -- all ones, the feature's row index, the parameter's number, a random value --
give, for every entry of q/k/v at the first token, ``value = s * code`` for an unknown scale ``s``
(the 1/sqrt(d) some modules fold into q), so the ratios to the all-ones forward name the parameter
and row exactly, and the random coding proves the path is a plain selection (no clamp, no
normalization written as ops, no bias added after the op). A LayerNorm/RMSNorm module applied to a
projection's codes (timm's qk_norm, Qwen3's q_norm/k_norm) hands them on unchanged: it is part of the
model, kept as it is, and named in a note. Only the first token is read, where rotary embeddings are the
identity. Anything that does not decode exactly is reported as unresolved, never guessed.
"""

from .decode import probe_blocks
from .inputs import hf_inputs
from .probe import PROBE_TOKENS
from .routes import ModuleDetection, checkpoint_names, detect_module

__all__ = ["PROBE_TOKENS", "ModuleDetection", "checkpoint_names", "detect_module", "hf_inputs", "probe_blocks"]
