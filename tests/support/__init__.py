"""What the tests share: generated trees and schemas (`trees`), the scalar oracle (`oracle`), case
generators (`scenarios`, `launch_kwargs`, `write_shapes`), backend comparisons (`kernel_diff`),
case budgets (`budget`), the schema fuzzer (`schema_fuzz`) and the fleet ranks' work
(`fleet_workers`)."""
