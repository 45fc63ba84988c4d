"""Cache hot-path ops. Each op file holds the pure-torch reference and the Triton kernel with its launcher;
the op's public name dispatches (Triton on CUDA, reference elsewhere; CACHEDEMB_BACKEND forces one)."""
from .bag_input import bag_repair
from .bag_backward import bag_backward, bag_backward_torch, bag_of_lookup, lookup_scale, per_sample_weights_grad
from .dispatch import backend_for, forced_backend, triton_available
from .id_index import index_build, index_delete, index_insert, index_lookup, index_lookup_torch, index_rebuild
from .pooled_forward import (
    HOST_LOC,
    MODE_MAX,
    MODE_MEAN,
    MODE_SUM,
    MODES,
    acc_dtype,
    host_loc,
    pooled_forward,
    pooled_forward_torch,
)
from .place import place_commit, place_lookup
from .row_copy import RowCopy, row_copy, row_copy_many, row_copy_many_torch, row_copy_torch, row_move
from .slot_rank import pool_rank
from .slot_score import SCORE_KINDS, SCORE_LFU, SCORE_LOOKAHEAD, SCORE_LRU, slot_score_triton
from .slot_lookup import EMPTY_KEY, slot_lookup, slot_lookup_torch
from .sparse_update import (
    ADAGRAD,
    ADAM,
    ROWWISE_ADAGRAD,
    SGD,
    UpdateRule,
    adam_step_size,
    backward_update,
    backward_update_torch,
    sparse_update,
    sparse_update_torch,
)
from .unique_ids import PAD_ID, unique_ids, unique_ids_torch
from .victim_select import PROTECTED, victim_select, victim_select_torch

__all__ = [name for name in dir() if not name.startswith("_")]
