"""Statuses: every code's name and text from the library, one exception class per error, the
library's message carried by the exception, kvt_last_error's lifetime."""

import pytest

import kvtier
from kvtier import Status


def test_every_status_name_matches_the_library():
    for s in Status:
        assert kvtier.status_name(s) == "KVT_" + s.name
        assert kvtier.strerror(s) not in ("", "unknown status")
    # the list ends where the binding's ends: the next code is unknown to the library too
    nxt = min(Status) - 1
    assert kvtier.status_name(nxt) == "KVT_UNKNOWN_STATUS"
    assert kvtier.strerror(nxt) == "unknown status"


def test_exception_classes():
    assert set(kvtier.ERROR_CLASSES) == {int(s) for s in Status if s != Status.OK}
    assert kvtier.ERROR_CLASSES[-10] is kvtier.BadStateError
    assert kvtier.ERROR_CLASSES[-1] is kvtier.InvalidArgumentError
    assert kvtier.ERROR_CLASSES[-15] is kvtier.ArchiveFullError
    for cls in kvtier.ERROR_CLASSES.values():
        assert issubclass(cls, kvtier.KvtError)
    e = kvtier._errors.error(-99, "kvt_x", "detail")
    assert type(e) is kvtier.KvtError and e.status == -99 and e.name == "KVT_UNKNOWN_STATUS"


def test_error_carries_name_and_library_message(mixed_ctx):
    b = mixed_ctx.batch(1)
    with pytest.raises(kvtier.BadStateError) as ei:
        b.plan()
    e = ei.value
    assert e.status == Status.ERR_BAD_STATE and e.name == "KVT_ERR_BAD_STATE"
    assert e.function == "kvt_batch_plan"
    assert e.message and e.message in str(e) and "KVT_ERR_BAD_STATE" in str(e)
    assert kvtier.last_error() == e.message  # still the thread's last failure
    b.reserve([mixed_ctx.sequence(1)], 1)  # a call that clears it and succeeds
    assert kvtier.last_error() == ""


def test_err_buffer_message_names_the_key(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"model_type": "llama", "num_hidden_layers": "many"}')
    with pytest.raises(kvtier.ParseError) as ei:
        kvtier.Model.from_file(p)
    assert ei.value.name == "KVT_ERR_PARSE" and "num_hidden_layers" in ei.value.message
