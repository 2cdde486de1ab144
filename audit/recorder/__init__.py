"""Producer-side block-table recorder and NULL_BLOCK_ID guard for vLLM's MooncakeStoreConnector.

``plugin`` (the vLLM general plugin), ``wrapper`` (the recording store class), ``blocks`` (source
address -> block id), ``records`` (the JSONL files). Nothing is imported here: vLLM imports the
plugin module in every process, and with the recorder off that must stay free.
"""
