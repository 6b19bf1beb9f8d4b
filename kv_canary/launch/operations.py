"""The operations of docs/semantics.md §5 as objects: write, verify, plan (and its two stages,
plan_offsets and plan_entries) and scatter.

Each operation holds everything about itself that is not the schema's: its own checks (its scalars,
the checks of the sizes its tensor rules bind, the relations between sizes, what it reads of a
context; on top of the generated tensor rules, kv_canary/launch/rules.py, and the checks of the
launch data classes, kv_canary/launch/validation.py), the tensor whose device picks the backend,
its reference call (kv_canary/backends/reference.py), its kernel launches and their work sizes, and
the index-value checks a host backend makes before any kernel writes (HostChecks, below).
The generated api (generated/api.py) calls `OPERATION.launch(runtime, backend, arguments)`; backends
and validation take the operation object, so a launch can be followed by reading, with no table of
names in between (docs/architecture.md, "The path of one launch").
"""
from __future__ import annotations

import operator
import os
from typing import Optional

import numpy as np
import torch

ENV_BACKEND = "KV_CANARY_BACKEND"


def _host(t: torch.Tensor) -> np.ndarray:
    """A read-only look at `t`'s values on the host. Through DLPack, not Tensor.numpy(): numpy()
    marks the caller's storage non-resizable for good, a side effect no check may have."""
    return np.from_dlpack(t.detach().to("cpu"))


class HostChecks:
    """The index-value checks of one generated tree (its padding row and its §7 message texts);
    `swa=False` leaves out the SWA indices (the torch reference checks those itself). Which of them
    an operation makes is the operation's (its `host_checks`).

    Only host backends (torch, cpu, emulated) can make them: they read index tensors. A request row
    outside req_to_token (or outside the scatter's pool) and an SWA index outside the LUT are engine
    bugs that a bug detector must not hide, so there a ValueError names the argument, the index and
    the bound before anything is written (docs/semantics.md §5.3, §7). The CUDA kernels cannot raise
    without synchronising the host: there such a request row is inactive (plan) or skipped
    (scatter), and an unreadable SWA index becomes kvc::PLAN_UNREADABLE_INDEX, which verify and write
    then report as SLOT_OUT_OF_RANGE (kv_canary/csrc/kvc_plan.cuh)."""

    def __init__(self, tree, *, swa: bool = True):
        self.layout = tree.layout
        self.padding = int(tree.layout.REQ_POOL_IDX_PADDING)
        self.swa = swa

    def request_rows(self, req_pool_indices: torch.Tensor, *, rows: int, table: str) -> None:
        """Every entry is the padding row or a row of `table` ([0, rows))."""
        rp = _host(req_pool_indices)
        bad = ((rp < 0) | (rp >= rows)) & (rp != self.padding)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            pad_note = "" if 0 <= self.padding < rows else f" and is not the padding row {self.padding}"
            raise ValueError(f"{self.layout.MESSAGE_PREFIX}req_pool_indices[{i}] = {int(rp[i])} is outside {table} rows "
                             f"[0, {rows}){pad_note}")

    def plan_rows(self, *, req_pool_indices, req_to_token, **_) -> None:
        self.request_rows(req_pool_indices, rows=int(req_to_token.shape[0]), table="req_to_token")

    def scatter_rows(self, *, req_pool_indices, pool_out, **_) -> None:
        self.request_rows(req_pool_indices, rows=int(pool_out.shape[0]), table="pool_out")

    def _verify_ranges(self, req_pool_indices, prefix_lens, req_to_token, swa_window_size):
        """(request rows, window start, verify count) per request, as the plan derives them (docs/semantics.md §5.3)."""
        rp, pre = _host(req_pool_indices), _host(prefix_lens)
        window, max_ctx = int(swa_window_size), int(req_to_token.shape[1])
        active = rp != self.padding  # request_rows ran first: every other row is inside the table
        pre_c = np.clip(pre, 0, max_ctx)
        start = np.maximum(pre_c - window, 0) if window > 0 else np.zeros(rp.size, dtype=np.int64)
        return rp, start, np.where(active, pre_c - start, 0)

    def _check_lut(self, values: np.ndarray, lut_len: int) -> None:
        bad = values >= lut_len
        if bad.any():
            raise self.layout.fail("swa_index", s=int(values[bad][0]), n=lut_len)

    def swa_indices(self, *, verify_capacity, **plan) -> None:
        """Every req_to_token value the whole plan translates lies inside the LUT (negatives pass through).

        A given LUT translates with or without a window (docs/semantics.md §5.3). Same values and order
        as the torch reference: the write seeds, then (when the verify plan does not overflow) the
        entries' slots, then their predecessors, so both raise the same text.
        """
        if not self.swa or plan["full_to_swa_index_mapping"] is None:
            return
        self.swa_seed_indices(**plan)
        rp, start, counts = self._verify_ranges(plan["req_pool_indices"], plan["prefix_lens"], plan["req_to_token"],
                                                plan["swa_window_size"])
        total = int(counts.sum())
        if total == 0 or total > int(verify_capacity):
            return  # an overflowing plan leaves its entries untouched: nothing else is read
        self._swa_entries(rp, start, counts, plan["req_to_token"], plan["full_to_swa_index_mapping"])

    def swa_seed_indices(self, *, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, swa_window_size,
                         full_to_swa_index_mapping, **_) -> None:
        """The plan's first stage: every write seed it translates lies inside the LUT."""
        if not self.swa or full_to_swa_index_mapping is None or int(req_to_token.shape[1]) == 0:
            return  # no LUT, or nothing to translate: every prefix clamps to 0
        rp, pre, ext = _host(req_pool_indices), _host(prefix_lens), _host(extend_seq_lens)
        table = _host(req_to_token).astype(np.int64)
        seeded = (rp != self.padding) & (pre > 0) & (ext > 0)
        self._check_lut(table[rp[seeded], np.minimum(pre[seeded] - 1, table.shape[1] - 1)],
                        int(full_to_swa_index_mapping.shape[0]))

    def swa_entry_indices(self, *, req_pool_indices, prefix_lens, req_to_token, swa_window_size,
                          full_to_swa_index_mapping, verify_enable, **_) -> None:
        """The plan's second stage (its scratch checked by plan_scratch): every entry's slot, then every
        predecessor, lies inside the LUT."""
        if not self.swa or full_to_swa_index_mapping is None or int(_host(verify_enable)[0]) == 0:
            return
        rp, start, counts = self._verify_ranges(req_pool_indices, prefix_lens, req_to_token, swa_window_size)
        if counts.sum():
            self._swa_entries(rp, start, counts, req_to_token, full_to_swa_index_mapping)

    def _swa_entries(self, rp, start, counts, req_to_token, lut) -> None:
        table = _host(req_to_token).astype(np.int64)
        total = int(counts.sum())
        req = np.repeat(np.arange(rp.size), counts)
        pos = start[req] + np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        rows = rp[req]
        lut_len = int(lut.shape[0])
        self._check_lut(table[rows, pos], lut_len)
        has_prev = pos > 0
        self._check_lut(table[rows[has_prev], pos[has_prev] - 1], lut_len)

    def plan_scratch(self, *, req_pool_indices, prefix_lens, req_to_token, swa_window_size, verify_offsets_scratch,
                     verify_enable, out_verify_slot_indices, **_) -> None:
        """The plan's second stage reads the verify offsets the first stage wrote for the same batch.

        An enabled plan (verify_enable != 0) whose scratch holds other offsets, or more entries than
        the capacity (the first stage disables such a plan), is a caller's bug: host backends raise.
        A disabled plan reads nothing. (A kernel would take the scratch as it is, never leaving a tensor.)
        """
        if int(_host(verify_enable)[0]) == 0:
            return
        _, _, counts = self._verify_ranges(req_pool_indices, prefix_lens, req_to_token, swa_window_size)
        want = np.concatenate(([0], np.cumsum(counts)))
        got = _host(verify_offsets_scratch)[: want.size]
        bad = np.flatnonzero(got != want)
        prefix = self.layout.MESSAGE_PREFIX
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{prefix}verify_offsets_scratch[{i}] = {int(got[i])}, but this batch's verify offsets "
                             f"give {int(want[i])}: pass the scratch launch_plan_offsets_kernel filled for the same "
                             f"requests")
        cap = int(out_verify_slot_indices.shape[0])
        if int(want[-1]) > cap:
            raise ValueError(f"{prefix}verify_enable is 1 but the batch has {int(want[-1])} verify entries, more than "
                             f"the capacity {cap} (out_verify_slot_indices length); launch_plan_offsets_kernel "
                             f"disables such a plan (verify_enable = 0)")


class Operation:
    """One operation: `name` is its name in the generated tables (kernel_abi.OPERATIONS, LAUNCHES)."""

    name = ""
    reads_real_kv = False  # write, verify: what validation reads of the real-KV sources, binding takes

    # -- what every operation does the same way --------------------------------------------------------
    def launch(self, runtime, backend: Optional[str], arguments: dict) -> None:
        """Validate `arguments`, choose the backend, bind and run (a free-function launch)."""
        self.prepare(runtime, backend, arguments).run()

    def prepare(self, runtime, backend: Optional[str], arguments: dict):
        """Everything before the kernel call: validation, the backend's choice, its binding (a Prepared)."""
        read = [] if self.reads_real_kv else None
        args = self.validate(runtime.validators, arguments, read)
        device = self.device(args)
        # The environment is read only when no backend= names one (a read costs about a microsecond).
        key = (backend, device) if backend is not None else (os.environ.get(ENV_BACKEND), device, None)
        chosen = runtime.chosen.get(key)
        if chosen is None:
            chosen = runtime.choose(backend, device, key)
        prepared = chosen.prepare(self, args, read=read)
        if self.has_host_checks and chosen.checks_index_values is not None:  # a host backend: it reads index values
            host, kernels = runtime.host_checks[chosen.checks_index_values], prepared.run

            def run() -> None:
                self.host_checks(host, args)  # before any kernel writes
                kernels()
            prepared.run = run
        return prepared

    def validate(self, v, arguments: dict, read: Optional[list] = None) -> dict:
        """Every check of this operation over a dict of its keywords (`v`: the tree's Validators);
        returns the backend operation's keyword arguments, normalised (input-field mappings become
        dicts with exactly the schema's keys). The keywords get their defaults from the generated
        table (kernel_abi.OPERATIONS[...].arguments: SGLang's names and defaults), then the operation
        makes its own checks (`check`, its tensors against their rules among them). `read` (write,
        verify) receives what the binding takes of the real-KV sources (real_kv_args). Last: no input
        shares memory with an output."""
        a, spans = self.check(v, v.keywords[self.name](**arguments), read)
        v.check_spans(spans)
        return a

    # -- what each operation says of itself -----------------------------------------------------------
    def size_checks(self, v) -> dict:
        """{size symbol: check(sizes)}: what is checked of a size its tensor rules bind, as soon as the
        tensor binding it passed (converted into the tree's rules once, Validators.tensors)."""
        return {}

    def device(self, args: dict):
        """The device of the tensor that picks the backend."""
        raise NotImplementedError

    def check(self, v, a: dict, read: Optional[list]) -> tuple:
        """The operation's own checks over its keywords (a dict, defaults filled in), with `v` the
        tree's Validators; returns (the backend operation's keywords, the spans of its tensors)."""
        raise NotImplementedError

    def reference(self, ref):
        """The torch reference's function for this operation (`ref`: the tree's generated reference)."""
        raise NotImplementedError

    def kernel_launches(self, backend, args: dict, read: Optional[list]) -> tuple:
        """(device, [bound kernel launch, ...]) on a kernel backend (kv_canary/backends/kernels.py)."""
        raise NotImplementedError

    def host_checks(self, host: HostChecks, args: dict) -> None:
        """What a host backend reads of index values before any kernel writes (none by default)."""

    has_host_checks = False

    def __repr__(self) -> str:
        return f"<kv-canary operation {self.name}>"


def _capacity(v, size: str, message: str, name: str = "", argument: str = ""):
    """A size check (Operation.size_checks): the size a rule bound is a capacity, above 0 and within
    the C int of the kernel argument `argument` ("": none), reported as `name` with the §7 text `message`."""
    return lambda sizes: v.check_capacity(name, sizes[size], message, argument)


def _columns(v):
    """A size check: req_to_token has a column (a request's seed is its last prefix column: a table
    without columns has none to read)."""
    def check(sizes: dict) -> None:
        if sizes["cols"] == 0:
            raise ValueError(f"{v.prefix}req_to_token must have at least 1 column (one per context position), "
                             f"got shape {(sizes['rows'], 0)}")
    return check


def _requests(v, write_capacity_of: str):
    """A size check: the batch's requests fit the write plan's capacity (`write_capacity_of` names it)."""
    def check(sizes: dict) -> None:
        if sizes["bs"] > sizes["wcap"]:
            raise ValueError(f"{v.prefix}req_pool_indices holds {sizes['bs']} requests but {write_capacity_of} is "
                             f"{sizes['wcap']}")
    return check


def _verify_capacity(v):
    return _capacity(v, "cap", "verify_capacity", "plan.verify_slot_indices capacity", "verify_capacity")


def _write_capacity(v):
    return _capacity(v, "wcap", "write_capacity", "plan.write_seed_slot_indices capacity", "write_req_capacity")


# The layout fields of a RealKvSource (after SGLang's four), in the kernels' parameter order, and a
# validated source's values of them as one tuple (what real_kv_reach takes).
REAL_KV_LAYOUT_FIELDS = ("token_stride_bytes", "num_heads", "head_stride_bytes", "chunk_bytes", "chunk_stride_bytes",
                         "token_group_size", "token_group_stride_bytes", "chunk_group_size", "chunk_group_stride_bytes")
source_layout = operator.attrgetter(*REAL_KV_LAYOUT_FIELDS)


def real_kv_reach(num_bytes_per_token: int, page_size: int, layout: tuple, align: int) -> tuple[bool, int, int]:
    """Where one row of a real-KV source is read (`layout`: its REAL_KV_LAYOUT_FIELDS values, checked;
    `align`: REAL_KV_LOAD_ALIGN_BYTES): (packed: SGLang's layout, the load width, the end of the
    farthest byte one row's slots read relative to the row's first byte)."""
    ts, heads, hs, chunk, cs, group, gs, cgroup, cgs = layout
    head = num_bytes_per_token // heads
    last_head = (heads - 1) * hs + (_farthest(head // chunk, cs, cgroup, cgs) + chunk if chunk else head)
    return (ts == num_bytes_per_token and heads == 1 and chunk == 0 and group == 0,
            chunk if 0 < chunk < align else align, _farthest(page_size, ts, group, gs) + last_head)


def _farthest(n: int, stride: int, group: int, group_stride: int) -> int:
    """The largest offset of items 0..n-1 (n >= 1) at `i * stride`, or, in groups of `group`, at
    `(i // group) * group_stride + (i % group) * stride`: the last item, or the last of the group before it."""
    last = n - 1
    if not group:
        return last * stride
    return max((last // group) * group_stride + (last % group) * stride,
               (last // group - 1) * group_stride + (group - 1) * stride if last >= group else 0)


def _row_bytes(size, strides) -> int:
    """The elements of one row of a tensor when they are one flat run (dims 1.. contiguous), else 0."""
    packed = 1
    for d in range(len(size) - 1, 0, -1):
        if size[d] != 1 and strides[d] != packed:
            return 0
        packed *= size[d]
    return packed


class ContextOperation(Operation):
    """An operation over a VerifyOrWriteContext and a plan (write, verify): what it reads of its
    context besides the tensor rules is its own to check, at every launch."""

    reads_real_kv = True

    def device(self, args):
        return args["context"].canary_buf.device

    def check_context(self, v, a: dict, plan_class) -> None:
        """What a write's or verify's context and plan are besides tensors (this tree's classes were
        checked when they were built)."""
        if type(a["context"]) is not v.classes.context:
            v.check_context_fields(a["context"])
        if type(a["plan"]) is not plan_class:
            v.check_plan_class(a["plan"], plan_class.__name__)

    def check_context_tensors(self, v, a: dict, read: Optional[list]) -> tuple:
        """A write's or verify's tensors (its rules), then what the rules cannot say of its context: the
        slot stride, the ring's capacity, its real-KV sources (read in place, so checked at every launch:
        a tensor moved since its source was built is caught) and, for a context of another class than
        this tree's, that no two of its tensors share memory."""
        sizes, spans = v.check_tensors(v.tensors[self.name], a)
        context = a["context"]
        frozen = type(context) is v.classes.context
        buf = context.canary_buf
        stride, word = buf.shape[1], v.layout.CANARY_WORD_BYTES
        if stride % word or stride // word < v.layout.CANARY_FIELDS_PER_SLOT:  # the record does not fit
            v.check_slot_stride(stride, buf.shape)  # raises
        v.check_fits("violation_ring capacity", sizes["ring"], argument="ring_capacity")
        if not frozen:
            v.check_source_list(context.real_kv_sources)
        self.real_kv_reads(v, context, buf.device, spans, read)
        if not frozen:
            v.check_context_disjoint(context)
        return a, spans

    def real_kv_reads(self, v, context, device, spans: list, read: Optional[list]) -> None:
        """Every real-KV source of a write's or verify's context (a list already checked), as the launch
        reads it: its span (an input) appended to the launch's `spans` and, where the binding takes them
        (`read`, kernel_abi.real_kv_args), its (data pointer, stride(0), element size, rows). A source
        of this tree's class had its integers and layout checked when it was built: its tensor on the
        device, its loads aligned and every byte its rows' slots read inside its storage is accepted
        in one pass (packed rows, the usual case: a contiguous tensor); any other source is checked
        whole (Validators.check_real_kv_source), which names the first thing that is wrong."""
        sources = context.real_kv_sources
        align = v.layout.REAL_KV_LOAD_ALIGN_BYTES
        cpu = device.type == "cpu"  # is_cpu reads faster than a device object
        source_class = v.classes.source
        for i, src in enumerate(sources):
            ok = False
            if type(src) is source_class:
                t = src.tensor
                if type(t) is torch.Tensor and (t.is_cpu if cpu else t.device == device):
                    ptr, es, size, strides = t.data_ptr(), t.itemsize, t.shape, t.stride()
                    rows = size[0] if len(size) >= 2 else 0
                    row_stride = strides[0] if rows else 0
                    if (src.num_heads == 1 and src.chunk_bytes == 0 and src.token_group_size == 0
                            and src.token_stride_bytes == src.num_bytes_per_token):
                        # packed rows (SGLang's layout): a row's bytes one flat run, the row stride may pad it
                        if t.is_contiguous():  # the usual case
                            n = t.nbytes
                            row_bytes = n // rows if rows else 0
                        else:
                            n, row_bytes = v.extent(t), _row_bytes(size, strides) * es
                        ok = (rows and not ptr % align and not row_stride * es % align
                              and row_bytes >= src.page_size * src.num_bytes_per_token
                              and t.storage_offset() * es + n <= t.untyped_storage().nbytes())
                    elif rows:  # slots where the layout puts them: every load aligned, every byte read in the storage
                        _, width, reach = real_kv_reach(src.num_bytes_per_token, src.page_size, source_layout(src),
                                                        align)
                        end = (rows - 1) * row_stride * es + reach
                        ok = (not row_stride * es % width and not ptr % width
                              and end <= t.untyped_storage().nbytes() - t.storage_offset() * es)
                        n = max(v.extent(t), end)
            if not ok:
                ptr, n, row_stride, es, rows = v.check_real_kv_source(i, src, device)
            if n and ptr:
                spans.append((ptr, ptr + n, v.source_names[i], False))
            if read is not None:
                read.append((ptr, row_stride, es, rows))
        if context.real_kv_hash_mode == v.partial_mode:  # as Validators.check_partial_read, when a context is allocated
            partial = v.layout.REAL_KV_PARTIAL_READ_BYTES
            for i, src in enumerate(sources):
                if src.num_bytes_per_token < partial:
                    raise v.fail("real_kv_partial", i=i, n=src.num_bytes_per_token)


class Write(ContextOperation):
    """Write the records of a WritePlan's chains (docs/semantics.md §5.1)."""

    name = "write"

    def size_checks(self, v):
        return {"wcap": _write_capacity(v)}

    def check(self, v, a, read):
        self.check_context(v, a, v.classes.write_plan)
        enabled = v.check_bool("enable_write_input_assert", a["enable_write_input_assert"])
        missing = (a["expected_input_tokens"] is None, a["expected_input_positions"] is None)
        if enabled and any(missing):
            raise v.fail("expected_inputs_required")
        if not enabled and not all(missing):
            raise v.fail("expected_inputs_forbidden")
        a["extra_inputs"] = v.mapping("extra_inputs", a["extra_inputs"], v.input_fields)
        return self.check_context_tensors(v, a, read)

    def reference(self, ref):
        return ref.write

    def kernel_launches(self, backend, args, read):
        device = backend.device_of(args["context"].canary_buf)
        return device, [backend.bound("write", args, read=read, device=device,
                                      work=int(args["plan"].write_seed_slot_indices.shape[0]))]


class Verify(ContextOperation):
    """Check the entries of a VerifyPlan, appending mismatches to the ring (docs/semantics.md §5.2)."""

    name = "verify"

    def size_checks(self, v):
        return {"cap": _verify_capacity(v)}

    def check(self, v, a, read):
        self.check_context(v, a, v.classes.verify_plan)
        v.check_bool("check_verify_expected_token", a["check_verify_expected_token"])
        a["extra_slot_tables"] = v.mapping("extra_slot_tables", a["extra_slot_tables"], v.per_slot_fields)
        return self.check_context_tensors(v, a, read)

    def reference(self, ref):
        return ref.verify

    def kernel_launches(self, backend, args, read):
        device = backend.device_of(args["context"].canary_buf)
        return device, [backend.bound("verify", args, read=read, device=device,
                                      work=int(args["plan"].verify_slot_indices.shape[0]),
                                      check_verify_expected_token=args["check_verify_expected_token"])]


class PlanOperation(Operation):
    """The plan and its two stages: the checks they share of their scalars and sizes."""

    has_host_checks = True

    def device(self, args):
        return args["req_to_token"].device

    def check_plan_scalars(self, v, a: dict) -> None:
        """The plan's (and its stages') window, offset, expected-token pool pairing and input-field mappings."""
        # A window <= 0 is full attention (SGLang's rule). A LUT, when given, translates every slot with
        # or without a window (docs/semantics.md §5.3); only a window needs one.
        window = v.check_fits("swa_window_size", v.check_int("swa_window_size", a["swa_window_size"]))
        if window > 0 and a["full_to_swa_index_mapping"] is None:
            raise ValueError(f"{v.prefix}full_to_swa_index_mapping is required when swa_window_size > 0, got None")
        if "kv_token_id_vs_position_offset" in a:
            v.check_fits("kv_token_id_vs_position_offset",
                         v.check_int("kv_token_id_vs_position_offset", a["kv_token_id_vs_position_offset"]))
        # The expected-token pool's valid lengths are ignored without a pool, as SGLang does (its
        # runtime passes them on every forward, pool or not: docs/sglang-compat.md).
        if a.get("req_to_verify_expected_tokens") is None:
            if "req_to_verify_expected_tokens_valid_lens" in a:
                a["req_to_verify_expected_tokens_valid_lens"] = None
        elif a["req_to_verify_expected_tokens_valid_lens"] is None:
            raise ValueError(f"{v.prefix}req_to_verify_expected_tokens and req_to_verify_expected_tokens_valid_lens "
                             f"must be given together, got only req_to_verify_expected_tokens")
        for kind in ("extra_request_values", "out_extra_verify_expected"):
            if kind in a:
                a[kind] = v.mapping(kind, a[kind], v.per_request_fields)

    def check_plan_sizes(self, v, a: dict, sizes: dict, scratch: str = "", *, entries: bool = True) -> None:
        """The scratch (argument `scratch`, if any) holds bs + 1 offsets, and the verify entries' total
        (at most bs x columns) is summed in 64 bits."""
        bs = sizes["bs"]
        if scratch and a[scratch].shape[0] < bs + 1:
            raise ValueError(f"{v.prefix}{scratch} must hold at least bs + 1 = {bs + 1} int64 entries (bs = "
                             f"req_pool_indices length), got shape {tuple(a[scratch].shape)}")
        if entries:
            v.check_extent("the verify plan", bs, "requests", sizes["cols"], "req_to_token columns",
                           unit="entries at most")


class Plan(PlanOperation):
    """Derive the verify and write plans of a batch: its two stages over a scratch (docs/semantics.md §5.3)."""

    name = "plan"

    def size_checks(self, v):
        return {"cols": _columns(v), "cap": _verify_capacity(v), "wcap": _write_capacity(v),
                "bs": _requests(v, "write_plan_out.write_req_capacity")}

    def check(self, v, a, read):
        if type(a["verify_plan_out"]) is not v.classes.verify_plan:
            v.check_plan_class(a["verify_plan_out"], "VerifyPlan")
        if type(a["write_plan_out"]) is not v.classes.write_plan:
            v.check_plan_class(a["write_plan_out"], "WritePlan")
        v.check_capacity("verify_capacity", a["verify_capacity"], "verify_capacity")
        self.check_plan_scalars(v, a)
        sizes, spans = v.check_tensors(v.tensors[self.name], a)
        if a["verify_capacity"] != sizes["cap"]:
            raise ValueError(f"{v.prefix}verify_capacity must equal verify_plan_out capacity {sizes['cap']}, "
                             f"got {a['verify_capacity']}")
        self.check_plan_sizes(v, a, sizes)
        return a, spans

    def reference(self, ref):
        return ref.plan

    def host_checks(self, host, args):
        host.plan_rows(**args)
        host.swa_indices(**args)  # both stages' indices

    def kernel_launches(self, backend, args, read):
        """The two stages, as SGLang's launch_canary_plan_kernels calls them, bound over a scratch of
        bs + 1 verify offsets that the first writes and the second reads (allocated once per binding:
        a prepared plan launched twice reuses it, stream-ordered, like any other buffer it binds)."""
        device = backend.device_of(args["req_to_token"])
        bs = int(args["req_pool_indices"].shape[0])
        scratch = args["req_pool_indices"].new_empty(bs + 1)  # int64 on its device; new_empty: half torch.empty's cost
        offsets, entries = backend.abi.PLAN.bind(args, scratch)  # the stages' values, as PLAN.args would bind them
        held = (args, scratch)  # what the stages' values point into
        return device, [backend.bound("plan_offsets", held, values=offsets, work=bs, device=device),
                        backend.bound("plan_entries", held, values=entries, device=device,
                                      work=int(args["verify_plan_out"].verify_slot_indices.shape[0]))]


class PlanOffsets(PlanOperation):
    """The plan's first stage: the write plan, the verify entry offsets (into the scratch) and the
    overflow decision; its outputs are the WritePlan's arrays and the VerifyPlan's scalars."""

    name = "plan_offsets"

    def size_checks(self, v):
        return {"cols": _columns(v), "wcap": _capacity(v, "wcap", "write_capacity"),
                "bs": _requests(v, "the write request capacity (out_write_seed_slot_indices length)")}

    def check(self, v, a, read):
        v.check_capacity("verify_capacity", a["verify_capacity"], "verify_capacity")
        self.check_plan_scalars(v, a)
        sizes, spans = v.check_tensors(v.tensors[self.name], a)
        self.check_plan_sizes(v, a, sizes, "out_verify_offsets_scratch", entries=False)
        return a, spans

    def reference(self, ref):
        return ref.plan_offsets

    def host_checks(self, host, args):
        host.plan_rows(**args)
        host.swa_seed_indices(**args)

    def kernel_launches(self, backend, args, read):
        device = backend.device_of(args["req_to_token"])
        return device, [backend.bound("plan_offsets", args, work=int(args["req_pool_indices"].shape[0]),
                                      device=device)]


class PlanEntries(PlanOperation):
    """The plan's second stage: the verify entries, from the offsets the first stage wrote (its
    outputs are the VerifyPlan's entry arrays; their capacity is theirs)."""

    name = "plan_entries"

    def size_checks(self, v):
        return {"cols": _columns(v), "cap": _capacity(v, "cap", "verify_capacity")}

    def check(self, v, a, read):
        self.check_plan_scalars(v, a)
        sizes, spans = v.check_tensors(v.tensors[self.name], a)
        self.check_plan_sizes(v, a, sizes, "verify_offsets_scratch")
        return a, spans

    def reference(self, ref):
        return ref.plan_entries

    def host_checks(self, host, args):
        host.plan_rows(**args)
        host.plan_scratch(**args)
        host.swa_entry_indices(**args)

    def kernel_launches(self, backend, args, read):
        device = backend.device_of(args["req_to_token"])
        return device, [backend.bound("plan_entries", args, work=int(args["out_verify_slot_indices"].shape[0]),
                                      device=device)]


class Scatter(Operation):
    """Copy each request's token ids into its row of the expected-token pool (docs/semantics.md §5.4)."""

    name = "scatter"
    has_host_checks = True

    def device(self, args):
        return args["pool_out"].device

    def check(self, v, a, read):
        sizes, spans = v.check_tensors(v.tensors[self.name], a)
        # pool_out's rows must be contiguous and must not overlap, or requests would land in each other's cells.
        pool_out = a["pool_out"]
        rows, cols = pool_out.shape
        if (cols > 1 and pool_out.stride(1) != 1) or (rows > 1 and pool_out.stride(0) < cols):
            raise ValueError(f"{v.prefix}pool_out rows must be contiguous and must not overlap (stride(1) == 1 and "
                             f"stride(0) >= {cols}), got shape {(rows, cols)} and strides {tuple(pool_out.stride())}")
        return a, spans

    def reference(self, ref):
        return ref.scatter

    def host_checks(self, host, args):
        host.scatter_rows(**args)

    def kernel_launches(self, backend, args, read):
        device = backend.device_of(args["pool_out"])
        bs = int(args["req_pool_indices"].shape[0])
        return device, ([backend.bound("scatter", args, work=bs, device=device)] if bs else [])


WRITE, VERIFY, PLAN, PLAN_OFFSETS, PLAN_ENTRIES, SCATTER = (Write(), Verify(), Plan(), PlanOffsets(), PlanEntries(),
                                                            Scatter())
# The generated tables name operations (kernel_abi.OPERATIONS, api.LAUNCHES); this is the one place a
# name becomes an object (Runtime.bind, the generated api's import).
BY_NAME = {op.name: op for op in (WRITE, VERIFY, PLAN, PLAN_OFFSETS, PLAN_ENTRIES, SCATTER)}
