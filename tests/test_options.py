"""One name per thing: unknown options name the component the user named and list the valid ones;
the loopback network is "loopback" in the API as on the command line."""

import pytest
import torch.distributed as dist

from sparsecomm import make_method, run_workers
from sparsecomm.core.validate import UnknownOptionError


def test_an_unknown_method_option_lists_the_valid_ones():
    with pytest.raises(UnknownOptionError) as err:
        make_method("spardl", density=0.01, x=1)
    assert str(err.value).startswith("spardl: unknown option 'x'; valid options: density, teams, sag, selector")


def test_an_option_for_another_method_blames_the_method_named_not_its_selector():
    with pytest.raises(TypeError) as err:
        make_method("topka", density=0.01, teams=2)
    message = str(err.value)
    assert message.startswith("topka: unknown option 'teams'; valid options: density, selector, cap, nonfinite")
    assert message.endswith("and those of its selector 'exact_topk': algorithm, check_finite")


def test_an_unknown_selector_option_names_the_selector():
    from sparsecomm import selectors

    with pytest.raises(UnknownOptionError, match=r"^selector 'mstopk': unknown option 'teams'; valid options: "
                                                 r"samplings, seed, check_finite$"):
        selectors.make("mstopk", teams=2)


def _world_size():
    return dist.get_world_size()


def test_run_workers_takes_the_loopback_network_by_the_cli_name():
    assert run_workers(2, _world_size, net="loopback", timeout=60) == [2, 2]
