//! Helpers for `metav1.Condition` lists (VirtualMachine status) that keep
//! `lastTransitionTime` stable while a condition's status does not change.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// A condition stamped now. `status` true/false becomes `"True"`/`"False"`.
pub fn new_condition(type_: &str, status: bool, reason: &str, message: &str, generation: Option<i64>) -> Condition {
    Condition {
        type_: type_.to_owned(),
        status: if status { "True" } else { "False" }.to_owned(),
        reason: reason.to_owned(),
        message: message.to_owned(),
        observed_generation: generation,
        last_transition_time: Time(k8s_openapi::jiff::Timestamp::now()),
    }
}

/// Insert or replace the condition of `new.type_`; when its status is unchanged
/// the old `lastTransitionTime` is kept.
pub fn set_condition(conditions: &mut Vec<Condition>, mut new: Condition) {
    match conditions.iter_mut().find(|c| c.type_ == new.type_) {
        Some(old) => {
            if old.status == new.status {
                new.last_transition_time = old.last_transition_time.clone();
            }
            *old = new;
        }
        None => conditions.push(new),
    }
}

/// True when both lists say the same, ignoring `lastTransitionTime`.
pub fn same_conditions(a: &[Condition], b: &[Condition]) -> bool {
    let key =
        |c: &Condition| (c.type_.clone(), c.status.clone(), c.reason.clone(), c.message.clone(), c.observed_generation);
    let mut a: Vec<_> = a.iter().map(key).collect();
    let mut b: Vec<_> = b.iter().map(key).collect();
    a.sort();
    b.sort();
    a == b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unchanged_status_keeps_its_transition_time() {
        let mut list = vec![];
        let first = new_condition("Ready", false, "Starting", "a", Some(1));
        let t0 = first.last_transition_time.clone();
        set_condition(&mut list, first);
        std::thread::sleep(std::time::Duration::from_millis(2));
        set_condition(&mut list, new_condition("Ready", false, "Starting", "b", Some(2)));
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].last_transition_time, t0);
        assert_eq!(list[0].message, "b");
        set_condition(&mut list, new_condition("Ready", true, "Running", "c", Some(2)));
        assert_ne!(list[0].last_transition_time, t0);
    }
}
