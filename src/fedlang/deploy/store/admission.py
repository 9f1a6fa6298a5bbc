"""The checks every mode makes of an upload before accepting it, written once.

An upload (a plain round's report, a secure round's answer to a stage, a buffered
session's report for a model version) fills one *slot*: what one client owes one task.
A mode reads the slot from its tables and `admit`s the upload:

1. the same bytes as the upload already accepted in the slot: a replay, which changes
   nothing (the client is told it was accepted, `replay: true`);
2. other bytes where an upload was accepted: 409 `conflict` (the first one stands);
3. a task the client was not given: 403 `not_assigned`;
4. a task that takes no more uploads (its round or session closed, or the client's part
   in it ended): 410, reason `late` (or the mode's own reason).

Each mode then adds its own checks (a secure round's stage, a session's staleness and
buffer), each one of `protocol`'s errors. The server admits an upload twice: before it
decodes the body (`precheck`, so a replay or a refusal costs no decoding) and again in
the transaction that accepts it, with the task's row locked.
"""

from __future__ import annotations

import dataclasses
import enum

from fedlang.deploy import protocol


class Assignment(enum.StrEnum):
    """A client's part in a task (`assignments.state`, `buffered_tasks.state`)."""

    ASSIGNED = "assigned"  # given the task; its upload is awaited
    REPORTED = "reported"  # its upload was accepted
    DROPPED = "dropped"  # it had not uploaded when the task (or a stage of it) closed


@dataclasses.dataclass(frozen=True)
class Slot:
    """What one client owes one task, as read in the transaction that admits an upload.

    Attributes:
      owner: the task as people read it: `round 3`, `session 2`.
      part: the part of it the upload is for (`stage 2 (share keys)`, `version 4`), or ''.
      upload: what the client sends: `report`, `message`.
      accepted: the digest of the upload already accepted in the slot, or None.
      assignment: the client's part in the task (`Assignment`), or None if it was not
        given the task.
      open: whether the slot takes an upload now.
      state: the task's state, as the refusal names it when the slot is not open.
      reason: the refusal's reason when the slot is not open.
    """

    owner: str
    part: str
    upload: str
    accepted: str | None
    assignment: str | None
    open: bool
    state: str
    reason: str = "late"

    @property
    def name(self) -> str:
        return f"{self.part} of {self.owner}" if self.part else self.owner


def admit(slot: Slot, digest: str) -> bool:
    """Whether an upload of `digest` into `slot` is a replay (True: accept it again and
    change nothing); False when it may be accepted (the mode's own checks follow).

    Raises:
      Conflict: another upload was accepted in the slot.
      Forbidden: the client was not given the task.
      Gone: the slot takes no more uploads.
    """
    if slot.accepted is not None:
        if slot.accepted == digest:
            return True
        raise protocol.Conflict(
            f"Expected the {slot.upload} this client already gave for {slot.name} (a replay "
            f"changes nothing), found a different one; a client gives one {slot.upload} "
            "there, and the first one stands."
        )
    if slot.assignment is None:
        raise protocol.Forbidden(
            f"Expected a {slot.upload} for a task this client was given, found one for "
            f"{slot.name}, which it was not assigned; check in to get a task."
        )
    if not slot.open:
        raise protocol.Gone(
            f"Expected a {slot.upload} while {slot.owner} is open, found it {slot.state}: the "
            f"{slot.upload} came too late and is not counted.",
            reason=slot.reason,
        )
    return False
