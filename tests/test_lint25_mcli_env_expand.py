"""An MCLI run config's environment when its command re-exports a variable through the shell
(`export FSDP_VERSION=${FSDP_VERSION:-2}`): bash expands it from `env_variables`, so the linter
judges with that value, not with its own shell's (which dropped FSDP2's findings); an expansion
of what the config does not set stays unknown."""

from __future__ import annotations

import pytest

from foundry_fp8.lint.rules.mcli import mcli_env

TRAIN = "composer train/train.py /mnt/config/parameters.yaml"


@pytest.mark.parametrize(("given", "value", "expected"), [
    ({"FSDP_VERSION": "2"}, "${FSDP_VERSION:-1}", {"FSDP_VERSION": "2"}),
    ({"FSDP_VERSION": "2"}, '"${FSDP_VERSION:-1}"', {"FSDP_VERSION": "2"}),
    ({"FSDP_VERSION": "2"}, "$FSDP_VERSION", {"FSDP_VERSION": "2"}),
    ({"FSDP_VERSION": ""}, "${FSDP_VERSION:-2}", {"FSDP_VERSION": "2"}),  # `:-`: empty too
    ({"FSDP_VERSION": ""}, "${FSDP_VERSION-2}", {"FSDP_VERSION": ""}),  # `-`: unset only
    ({"V": "2", "FSDP_VERSION": "1"}, "${V}", {"V": "2", "FSDP_VERSION": "2"}),
    ({}, "${FSDP_VERSION:-2}", {}),  # the image's environment may set it: unknown
    ({"FSDP_VERSION": "1"}, "$(cat version)", {}),  # a command's output: unknown
])
def test_an_export_expanded_from_env_variables_is_bash_s_value(given, value, expected):
    command = f"cd llm-foundry/scripts\nexport FSDP_VERSION={value}\n{TRAIN}"
    assert mcli_env({"env_variables": given, "command": command}) == expected


def test_an_export_expanded_from_an_earlier_export():
    command = f"export V=2\nexport FSDP_VERSION=${{V:-1}}\n{TRAIN}"
    assert mcli_env({"command": command}) == {"V": "2", "FSDP_VERSION": "2"}
