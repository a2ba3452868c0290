"""The run's part of trainer_state.json is one record (comlrl.checkpoint.state.RunRecord): a saved
state holds exactly its fields and the manager's, and every field a resume checks is one of them."""

import json

from comlrl.checkpoint.state import _FIELDS, RunRecord

MANAGER_FIELDS = {"world_size", "rng", "rng_other_ranks", "schedulers", "optimizers"}


def test_a_saved_state_is_the_record_and_the_managers_fields(make_trainer, tmp_path):
    trainer = make_trainer(num_train_epochs=1)
    trainer.train(checkpoint_dir=tmp_path / "ck")
    state = json.loads((tmp_path / "ck" / "checkpoint-1" / "trainer_state.json").read_text())
    record = set(RunRecord.__dataclass_fields__)
    assert set(state) == record | MANAGER_FIELDS
    assert set(_FIELDS) <= record | MANAGER_FIELDS
    again = RunRecord.from_json(state)
    assert again.to_json() == {name: state[name] for name in record}
