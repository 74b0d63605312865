"""Who may do what: Redis ACL users per role and per worker (`kvq acl`), worker identity
(one live process per worker id), and secrets kept out of logs and `kvq config show`."""
