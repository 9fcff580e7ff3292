"""Importing this module registers echotrain's losses and BA advantages in verl (a verl plugin).

verl imports plugin modules in every process that imports ``verl`` (driver and Ray workers):
set ``VERL_USE_EXTERNAL_MODULES=echotrain.integrations.verl_plugin`` in the environment of the
run (Ray passes it to the workers through ``runtime_env``), or declare this module under the
``verl.plugins`` entry-point group of an installed package. Then use the names in
:data:`echotrain.integrations.verl.POLICY_LOSS_NAMES` / ``ADV_ESTIMATORS`` in the verl config.
It registers the default echotrain config (ECHO band ``ECHO_DEFAULT_BATCH_BAND``); call
:func:`echotrain.integrations.verl.register_with_verl` yourself for other values.
"""

from echotrain.integrations.verl import register_with_verl

REGISTERED = register_with_verl()
