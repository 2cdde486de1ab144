"""SGLang HiCache's MooncakeStore: its keys (`keys`), its host pool's pages as a model config
sizes them (`pages`), behind the producer interface (`producer`)."""
