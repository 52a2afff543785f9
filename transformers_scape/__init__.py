"""transformers_scape: SCAPE for ``transformers.Trainer`` and its subclasses (TRL's SFTTrainer, ...).

    from transformers_scape import ScapeTrainer
    trainer = ScapeTrainer(model=model, args=args, train_dataset=data, scape=dict(sparsity=0.99))
    trainer.train()                                  # or trainer.train(resume_from_checkpoint=True)

    class ScapeSFTTrainer(ScapeTrainerMixin, SFTTrainer): pass   # any other Trainer subclass
"""

from transformers_scape.trainer import SCAPE_STATE_NAME, ScapeTrainer, ScapeTrainerMixin

__all__ = ["SCAPE_STATE_NAME", "ScapeTrainer", "ScapeTrainerMixin"]
