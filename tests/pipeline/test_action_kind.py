"""ActionKind: a str-valued Enum that prints, formats, hashes and compares as its short value."""

from __future__ import annotations

import json
import pickle

from mpi4dl_nb.config import ParallelConfig, ScheduleKind
from mpi4dl_nb.pipeline.actions import KINDS, P2P_KINDS, Action, ActionKind
from mpi4dl_nb.pipeline.schedules import build_schedule, gems


def test_members_behave_like_their_values():
    forward = ActionKind.FORWARD
    assert str(forward) == "F" and f"{forward}" == "F" and f"{forward:>3}" == "  F"
    assert forward == "F" and hash(forward) == hash("F") and {"F": 1}[forward] == 1
    assert json.dumps([forward]) == '["F"]'
    assert pickle.loads(pickle.dumps(forward)) is forward
    assert ActionKind("SEND_GRAD") is ActionKind.SEND_GRAD
    assert [str(k) for k in KINDS] == ["F", "B", "I", "W", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD",
                                       "ALLREDUCE", "OPTIM"]


def test_kind_properties_partition_the_kinds():
    assert {k for k in ActionKind if k.is_compute} == {ActionKind.FORWARD, ActionKind.BACKWARD,
                                                        ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT}
    assert {k for k in ActionKind if k.is_p2p} == set(P2P_KINDS)
    assert {k for k in ActionKind if k.is_send} == {ActionKind.SEND_ACT, ActionKind.SEND_GRAD}
    assert {k for k in P2P_KINDS if k.carries_activation} == {ActionKind.SEND_ACT, ActionKind.RECV_ACT}


def test_every_scheduled_action_has_an_enum_kind_and_readable_text():
    schedule = build_schedule(ParallelConfig(split_size=2, spatial_size=0, parts=2), "1f1b")
    assert schedule.kind is ScheduleKind.ONE_F_ONE_B and f"{schedule.kind}" == "1f1b"
    actions = [a for r in range(schedule.world_size) for a in schedule.actions(r)]
    assert all(isinstance(a.kind, ActionKind) for a in actions)
    send = next(a for a in actions if a.kind is ActionKind.SEND_ACT)
    assert send.label() == f">{send.peer} act {send.micro_batch}"
    assert "send activation of stage 0" in send.describe()
    grad = next(a for a in actions if a.kind is ActionKind.RECV_GRAD)
    assert f"recv gradient of stage {grad.stage}" in grad.describe()
    assert "kind='F'" in repr(next(a for a in actions if a.kind is ActionKind.FORWARD))


def test_gems_accepts_the_schedule_as_text_or_member():
    assert gems(2, 2, kind="1f1b").table() == gems(2, 2, kind=ScheduleKind.ONE_F_ONE_B).table()
    assert Action(ActionKind.OPTIM, 0, 3).label() == "OPT"
