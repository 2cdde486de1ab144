"""The consumer's side of vLLM's MooncakeStoreConnector: which request each load serves, and how a
refused value fails it.

The connector loads in ``KVCacheStoreRecvingThread._handle_request(req_meta)``: it builds the keys of
one request, calls ``store.batch_get_into_multi_buffers`` from that thread, and hands every negative
result to ``_report_load_error(req_id, block_ids)``. So the request a load serves is the one that
thread is handling (`current_request`), and a value the guard refuses is reported as a failed get.
``_report_load_error`` fails the whole request only where there is more than one KV-cache group;
with one group (a pure Mamba model) it invalidates the failed blocks, the scheduler cuts back to the
block's start, where no recurrent state exists, and the output stays wrong (issue #29: 4 of 7
requests). A request with a refusal is therefore always failed as a whole, so that
``kv_load_failure_policy="recompute"`` recomputes it from its first token.
"""

from __future__ import annotations

import functools
import re
import sys
import threading

WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker"
RECEIVER = "KVCacheStoreRecvingThread"
# vLLM 0.32 keeps the API's request id with a random suffix (``10-b9212f4a`` for ``10``)
_INTERNAL_SUFFIX = re.compile(r"-[0-9a-f]{8}$")

_context = threading.local()


class HookError(RuntimeError):
    """The running vLLM is not one whose load path the guard knows: it must not start unguarded."""


def api_request_id(vllm_request_id: str | None) -> str | None:
    """The id the API gave a request, from vLLM's internal one."""
    if vllm_request_id is None:
        return None
    return _INTERNAL_SUFFIX.sub("", vllm_request_id)


def current_request() -> tuple[str | None, str | None]:
    """(API id, vLLM id) of the request whose load runs on this thread; (None, None) outside one."""
    vllm_id = getattr(_context, "request_id", None)
    return api_request_id(vllm_id), vllm_id


def note_refusal() -> None:
    """The guard refused a value of the request this thread loads: fail the request as a whole."""
    _context.refused = True


def hook_receiving_thread(required: bool) -> bool:
    """Wrap the receiving thread's ``_handle_request`` (the request each load serves) and
    ``_report_load_error`` (a request with a refusal fails whole), once.

    False where no vLLM is loaded (a store built by other code). With `required` (the load guard is
    on), a vLLM without that worker module or a receiving thread without those methods is a HookError."""
    module = sys.modules.get(WORKER_MODULE)
    if module is None and "vllm" not in sys.modules:
        return False  # not vLLM's connector (another client of the store): loads are still checked
    receiver = getattr(module, RECEIVER, None)
    handle = getattr(receiver, "_handle_request", None)
    report = getattr(receiver, "_report_load_error", None)
    if handle is None or report is None or not hasattr(receiver, "set_failed_request"):
        if required:
            found = "not loaded" if receiver is None else "without _handle_request/_report_load_error/set_failed_request"
            raise HookError(f"mooncake-audit load guard: vLLM's {RECEIVER} is {found}; this vLLM's load path is "
                            "unknown to the guard, so the engine does not start unguarded")
        return False
    if getattr(handle, "audit_hooked", False):
        return True

    @functools.wraps(handle)
    def _handle_request(self, req_meta, *args, **kwargs):
        _context.request_id = str(getattr(req_meta, "req_id", None))
        _context.refused = False
        try:
            return handle(self, req_meta, *args, **kwargs)
        finally:
            _context.request_id = None
            _context.refused = False

    @functools.wraps(report)
    def _report_load_error(self, req_id, block_ids, *args, **kwargs):
        if getattr(_context, "refused", False):
            return self.set_failed_request(req_id)
        return report(self, req_id, block_ids, *args, **kwargs)

    _handle_request.audit_hooked = True
    receiver._handle_request = _handle_request
    receiver._report_load_error = _report_load_error
    return True
