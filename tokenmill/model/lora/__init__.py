"""LoRA adapters over the base model's linears: PEFT adapters read and checked against the base
(``peft.py``), their weights in the form the compute reads (``weights.py``), and the slots that
apply up to ``max_loras`` of them to the rows of one batch (``slots.py``)."""
