"""What the tests share: generated layers and schemas (`layers`), the scalar oracle (`oracle`), case
generators (`scenarios`, `launch_kwargs`, `write_shapes`), backend comparisons (`kernel_diff`),
case budgets (`budget`), the schema fuzzer (`schema_fuzz`) and the fleet ranks' work
(`fleet_workers`)."""
