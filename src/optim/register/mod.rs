//! Registration's views of the groups: `param_groups` as torch shows them.
mod groups_json;
