"""The one exception type the contract raises for things a user can fix (bad config, bad
checkpoint, bad token id, bad input trace). The CLI turns it into exit status 2 and one line."""


class ContractError(Exception):
    pass
